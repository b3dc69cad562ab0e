"""The receipt of every request against a real server: exact metrics for a known workload, the
usage ledger (one priced row per request, whatever ended it: finished, stop string, client
disconnect, server timeout) read through SQLite, ``tokenline usage --json`` and ``/admin/usage``,
``--log-prompts``, and durability of the ledger across a kill -9 under load.

Two servers (each start costs a few seconds), both with tenant keys and a price table: the main
one with ``--log-prompts``, on which the tests run in file order (the metrics test needs it fresh,
the crash test kills it), and one with ``--request-timeout 1`` for the requests it times out.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, wait_until
from tokenline.cli import main as cli_main
from tokenline.gateway.keys import add_key
from tokenline.gateway.ledger import UsageLedger, UsageRecord

MODEL = "SmolLM2-135M-Instruct"
INPUT_PRICE, OUTPUT_PRICE = 0.45, 3.20  # USD per million tokens
PROMPT_IDS = list(range(2000, 2010))
TPM = 50
MAX_REQUEST_BYTES = 8192
SECRET = "okapi-narwhal-4242"


def cost(prompt: int, completion: int) -> float:
    # No cached_input price: cached prompt tokens cost the full input price.
    return (prompt * INPUT_PRICE + completion * OUTPUT_PRICE) / 1e6


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


Labels = frozenset[tuple[str, str]]
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(server: Server) -> dict[tuple[str, Labels], float]:
    """Every sample of /metrics, keyed by (name, labels)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, line
        name, labels, value = match.groups()
        samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
    return samples


def sample(samples: dict[tuple[str, Labels], float], name: str, **labels: str) -> float:
    """The one sample of ``name`` with exactly these labels (vllm: series also get model_name)."""
    if name.startswith("vllm:"):
        labels = {"model_name": MODEL, **labels}
    key = (name, frozenset(labels.items()))
    assert key in samples, (name, labels, sorted(k for k in samples if k[0] == name))
    return samples[key]


@dataclass
class ReceiptServer:
    server: Server
    keys: dict[str, str]
    db: Path

    def url(self, path: str) -> str:
        return f"{self.server.base_url}{path}"

    def post(self, tenant: str | None, path: str, body: dict[str, Any], request_id: str | None = None,
             timeout: float = 60) -> httpx.Response:
        headers = auth(self.keys[tenant] if tenant else None)
        if request_id:
            headers["X-Request-Id"] = request_id
        return httpx.post(self.url(path), json=body, headers=headers, timeout=timeout)

    def records(self, **query: Any) -> list[UsageRecord]:
        ledger = UsageLedger(self.db)
        try:
            # A journaled row still in flight is not a receipt yet: only completed rows count.
            return [r for r in ledger.records(limit=None, **query) if r.status != "in_flight"]
        finally:
            ledger.close()

    def record(self, request_id: str) -> UsageRecord | None:
        rows = self.records(request_id=request_id)
        assert len(rows) <= 1, rows  # one record per request, never two
        return rows[0] if rows else None


@pytest.fixture(scope="module")
def receipt(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ReceiptServer]:
    tmp = tmp_path_factory.mktemp("receipt")
    keys_file = tmp / "keys.toml"
    keys = {
        "admin": add_key(keys_file, "admin", admin=True),
        "alice": add_key(keys_file, "alice"),
        "tpm": add_key(keys_file, "tpm", tokens_per_minute=TPM),
    }
    prices = tmp / "prices.toml"
    prices.write_text(f'[models."{MODEL}"]\ninput = {INPUT_PRICE}\noutput = {OUTPUT_PRICE}\n')
    # /metrics open and labelled by tenant, as an operator opts in to (the defaults hide both).
    with start_server(tmp, "--keys", str(keys_file), "--prices", str(prices), "--log-prompts",
                      "--max-request-bytes", str(MAX_REQUEST_BYTES),
                      "--metrics-auth", "none", "--metrics-tenant-labels") as server:
        port = server.base_url.rsplit(":", 1)[1]
        yield ReceiptServer(server, keys, tmp / f"usage-{port}.sqlite3")


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ReceiptServer]:
    """A second server, with ``--request-timeout 1`` (kept apart so that a slow machine cannot time
    out the other tests' requests)."""
    tmp = tmp_path_factory.mktemp("receipt-timeout")
    keys_file = tmp / "keys.toml"
    keys = {"admin": add_key(keys_file, "admin", admin=True), "alice": add_key(keys_file, "alice")}
    prices = tmp / "prices.toml"
    prices.write_text(f'[models."{MODEL}"]\ninput = {INPUT_PRICE}\noutput = {OUTPUT_PRICE}\n')
    with start_server(tmp, "--keys", str(keys_file), "--prices", str(prices), "--request-timeout", "1") as server:
        port = server.base_url.rsplit(":", 1)[1]
        yield ReceiptServer(server, keys, tmp / f"usage-{port}.sqlite3")


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# --- 7. metrics, exactly, on the fresh server -------------------------------------------------


def test_metrics_of_a_known_workload_are_exact(receipt: ReceiptServer) -> None:
    before = scrape(receipt.server)
    # Fresh: no request has been counted (a labelled counter may have no sample before its first one).
    assert before.get(("vllm:generation_tokens_total", frozenset({("model_name", MODEL)})), 0) == 0
    assert sample(before, "vllm:num_requests_running") == 0

    prompt_tokens = []
    costs = []
    for i, prompt in enumerate(["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello", "A B C D"]):
        response = receipt.post("alice", "/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 7, "ignore_eos": True,
        }, request_id=f"metrics-cmpl-{i}")
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["completion_tokens"] == 7
        prompt_tokens.append(usage["prompt_tokens"])
        costs.append(cost(usage["prompt_tokens"], 7))
    for i in range(2):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 5,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", receipt.url("/v1/chat/completions"), json=body, timeout=60,
                          headers={**auth(receipt.keys["alice"]), "X-Request-Id": f"metrics-chat-{i}"}) as response:
            assert response.status_code == 200
            events = sse_events(response)
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 5
        prompt_tokens.append(usage["prompt_tokens"])
        costs.append(cost(usage["prompt_tokens"], 5))

    # Refused at the edge, never reaching the engine: a 401, a 413 and two 400s (larger than the TPM).
    assert httpx.post(receipt.url("/v1/completions"), json={"model": MODEL, "prompt": "x"},
                      headers=auth("tl-wrong"), timeout=10).status_code == 401
    big = {"model": MODEL, "prompt": "x" * (MAX_REQUEST_BYTES + 1)}
    assert receipt.post("alice", "/v1/completions", big).status_code == 413
    for _ in range(2):  # 10 + 100 tokens > TPM 50: too large for this tenant
        refused = receipt.post("tpm", "/v1/completions", {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 100})
        assert refused.status_code == 400 and "retry-after" not in refused.headers, refused.text

    m = scrape(receipt.server)
    n = 7
    assert sample(m, "vllm:generation_tokens_total") == 5 * 7 + 2 * 5 == 45
    assert sample(m, "vllm:prompt_tokens_total") == sum(prompt_tokens)
    assert sample(m, "vllm:request_success_total", finished_reason="length") == n
    assert sum(v for (name, _), v in m.items() if name == "vllm:request_success_total") == n
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                      "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                      "vllm:request_generation_tokens", "vllm:request_time_per_output_token_seconds"):
        assert sample(m, f"{histogram}_count") == n, histogram
        assert sample(m, f"{histogram}_bucket", le="+Inf") == n, histogram
    assert sample(m, "vllm:request_generation_tokens_sum") == 45
    assert sample(m, "vllm:request_prompt_tokens_sum") == sum(prompt_tokens)
    # Buckets of the token histograms: 7-token requests are <= 10, all 5-token ones <= 5.
    assert sample(m, "vllm:request_generation_tokens_bucket", le="5.0") == 2
    assert sample(m, "vllm:request_generation_tokens_bucket", le="10.0") == n
    # Each request's first token ends the prefill; at most 45 - 7 gaps between output batches.
    assert 1 <= sample(m, "vllm:inter_token_latency_seconds_count") <= 45 - n
    assert sample(m, "vllm:num_requests_running") == 0
    assert sample(m, "vllm:num_requests_waiting") == 0
    assert sample(m, "tokenline_inflight_requests") == 0

    assert sample(m, "tokenline_rejected_requests_total", reason="unauthorized") == 1
    assert sample(m, "tokenline_rejected_requests_total", reason="body_too_large") == 1
    assert sample(m, "tokenline_rejected_requests_total", reason="rate_limited") == 2
    assert sample(m, "tokenline_rate_limited_requests_total", tenant="tpm", limit="rate_limit_exceeds_capacity") == 2
    rate_limited = [v for (name, _), v in m.items() if name == "tokenline_rate_limited_requests_total"]
    assert sum(rate_limited) == 2

    ledger_cost = sum(r.cost_usd for r in receipt.records())
    spend = sample(m, "tokenline_spend_usd_total", tenant="alice", model_name=MODEL)
    assert spend == pytest.approx(ledger_cost, rel=1e-9, abs=1e-15)
    assert spend == pytest.approx(sum(costs), rel=1e-9)
    assert [v for (name, labels), v in m.items() if name == "tokenline_spend_usd_total"] == [spend]
    # Every vllm: series is labelled with the served model's name.
    for name, labels in m:
        if name.startswith("vllm:"):
            assert dict(labels).get("model_name") == MODEL, (name, labels)
    # The conftest's reader agrees on the plain series.
    plain = receipt.server.metrics()
    assert plain["vllm:generation_tokens_total"] == 45


# --- 5. the ledger ------------------------------------------------------------------------------


def test_ledger_has_one_priced_record_per_request_however_it_ended(receipt: ReceiptServer) -> None:
    # Finished (length).
    finished = receipt.post("alice", "/v1/completions", {
        "model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 6, "ignore_eos": True,
    }, request_id="led-finished")
    assert finished.status_code == 200, finished.text
    finished_usage = finished.json()["usage"]
    assert finished_usage["completion_tokens"] == 6

    # Cancelled: the client drops the stream after three content chunks.
    chunks = 0
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", receipt.url("/v1/completions"), json=body,
                           headers={**auth(receipt.keys["alice"]), "X-Request-Id": "led-cancelled"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    chunks += 1
                    if chunks == 3:
                        break
    assert chunks == 3

    # Cancelled, not streamed: the client gives up (read timeout) before the answer comes.
    with pytest.raises(httpx.ReadTimeout):
        receipt.post("alice", "/v1/completions", {
            "model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True,
        }, request_id="led-cancelled-full", timeout=0.4)

    ids = ["led-finished", "led-cancelled", "led-cancelled-full"]
    # Aborted requests are settled in the background, once the engine reports what it produced.
    assert wait_until(lambda: all(receipt.record(i) for i in ids), timeout=15), [receipt.record(i) for i in ids]
    rows = {i: receipt.record(i) for i in ids}
    for request_id, row in rows.items():
        assert row is not None
        assert row.request_id == request_id
        assert row.tenant == "alice" and row.model == MODEL
        assert row.prompt_tokens == len(PROMPT_IDS)
        assert 0 <= row.cached_tokens <= row.prompt_tokens
        assert row.cost_usd == pytest.approx(cost(row.prompt_tokens, row.completion_tokens), rel=1e-12)
        assert row.e2e_s is not None and row.e2e_s > 0
        assert abs(row.created_at - time.time()) < 120

    assert rows["led-finished"].status == "finished"
    assert rows["led-finished"].finish_reason == "length"
    assert rows["led-finished"].completion_tokens == finished_usage["completion_tokens"] == 6
    assert rows["led-finished"].cached_tokens == finished_usage["prompt_tokens_details"]["cached_tokens"]

    assert rows["led-cancelled"].status == "cancelled"
    assert rows["led-cancelled"].finish_reason == rows["led-cancelled-full"].finish_reason == "abort:client_disconnect"
    assert chunks <= rows["led-cancelled"].completion_tokens < 200
    assert rows["led-cancelled-full"].status == "cancelled"
    assert rows["led-cancelled-full"].completion_tokens < 200  # it ran for about 0.4 s, not to the end


def test_ledger_records_requests_the_server_timed_out(timeout_server: ReceiptServer) -> None:
    receipt = timeout_server
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True, "stream": True}
    # Timed out by the server (--request-timeout 1), not streamed: a 504.
    timed_out = receipt.post("alice", "/v1/completions", {
        "model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True,
    }, request_id="led-timeout")
    assert timed_out.status_code == 504, timed_out.text
    assert timed_out.json()["error"]["type"] == "timeout_error"

    # Timed out while streaming: the error arrives as an event, then [DONE].
    with httpx.stream("POST", receipt.url("/v1/completions"), json=body, timeout=60,
                      headers={**auth(receipt.keys["alice"]), "X-Request-Id": "led-timeout-stream"}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "timeout_error", events[-2]
    streamed_chunks = sum(1 for e in events[:-2] if e["choices"] and e["choices"][0]["text"])

    ids = ["led-timeout", "led-timeout-stream"]
    assert wait_until(lambda: all(receipt.record(i) for i in ids), timeout=15), [receipt.record(i) for i in ids]
    for request_id, seen in (("led-timeout", 1), ("led-timeout-stream", streamed_chunks)):
        row = receipt.record(request_id)
        assert row is not None
        assert row.status == "timed_out" and row.finish_reason == "abort:timeout", row
        assert row.tenant == "alice" and row.model == MODEL
        assert row.prompt_tokens == len(PROMPT_IDS)
        assert row.cost_usd == pytest.approx(cost(row.prompt_tokens, row.completion_tokens), rel=1e-12)
        # It ran for about a second: tokens were produced, and all are billed; far from 200.
        assert max(1, seen) <= row.completion_tokens < 200, row
        assert 0.9 <= row.e2e_s < 8, row  # the 1 s timeout, not a 10 s wait for a receipt
    # The admin view of this server's ledger counts them too.
    usage = httpx.get(receipt.url("/admin/usage"), headers=auth(receipt.keys["admin"]), timeout=10).json()["data"]
    rows = receipt.records()
    assert usage == [{
        "tenant": "alice", "model": MODEL, "requests": len(rows), "prompt_tokens": len(PROMPT_IDS) * len(rows),
        "cached_tokens": sum(r.cached_tokens for r in rows),
        "completion_tokens": sum(r.completion_tokens for r in rows),
        "cost_usd": pytest.approx(sum(r.cost_usd for r in rows), rel=1e-9),
    }]
    assert len(rows) == 2


def _stop_string_request(receipt: ReceiptServer, request_id: str) -> tuple[dict[str, Any], UsageRecord]:
    response = receipt.post("alice", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": f"Reply with one word. {SECRET}"}],
        "max_tokens": 25, "temperature": 0, "stop": [" "],
    }, request_id=request_id)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    usage = response.json()["usage"]
    assert usage["completion_tokens"] < 25
    row = receipt.record(request_id)
    assert row is not None  # a finished request is billed before its response is sent
    return usage, row


def test_ledger_records_a_request_ended_by_a_stop_string(receipt: ReceiptServer) -> None:
    """The receipt the client got and the ledger agree on the completion tokens, also when a stop
    string ended the text before the engine stopped (regression: the ledger billed the tokens the
    engine produced until the abort reached it, the response counted one fewer)."""
    usage, row = _stop_string_request(receipt, "led-stopped")
    assert row.status == "finished" and row.finish_reason == "stop"
    assert row.prompt_tokens == usage["prompt_tokens"]
    assert row.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]
    assert row.cost_usd == pytest.approx(cost(row.prompt_tokens, row.completion_tokens), rel=1e-12)
    assert row.completion_tokens == usage["completion_tokens"], (row, usage)
    for i in range(2):  # the engine's lag behind the stop varies; every time they must agree
        usage, row = _stop_string_request(receipt, f"led-stopped-{i}")
        assert row.completion_tokens == usage["completion_tokens"], (row, usage)


def test_streamed_usage_equals_the_ledger_after_a_stop_string(receipt: ReceiptServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Reply with one word."}], "max_tokens": 25,
            "temperature": 0, "stop": [" "], "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", receipt.url("/v1/chat/completions"), json=body, timeout=60,
                      headers={**auth(receipt.keys["alice"]), "X-Request-Id": "led-stopped-stream"}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]] == ["stop"]
    row = receipt.record("led-stopped-stream")
    assert row is not None and row.status == "finished"
    assert row.completion_tokens == usage["completion_tokens"], (row, usage)


def test_usage_cli_and_admin_endpoint_agree_with_the_records(receipt: ReceiptServer) -> None:
    records = receipt.records()
    assert records, "the earlier tests wrote records"
    assert {r.tenant for r in records} == {"alice"}  # refused requests are never billed
    ids = [r.request_id for r in records]
    assert len(ids) == len(set(ids))
    expected = {
        "tenant": "alice", "model": MODEL, "requests": len(records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "cost_usd": sum(r.cost_usd for r in records),
    }

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["usage", "--db", str(receipt.db), "--json"]) == 0
    report = json.loads(out.getvalue())
    assert len(report["rows"]) == 1
    row = report["rows"][0]
    assert row == {**expected, "cost_usd": pytest.approx(expected["cost_usd"], rel=1e-9)}
    assert report["total"]["requests"] == len(records)
    assert report["total"]["cost_usd"] == pytest.approx(expected["cost_usd"], rel=1e-9)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["usage", "--db", str(receipt.db), "--json", "--tenant", "nobody"]) == 0
    assert json.loads(out.getvalue())["rows"] == []

    response = httpx.get(receipt.url("/admin/usage"), headers=auth(receipt.keys["admin"]), timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "list"
    assert response.json()["data"] == [{**expected, "cost_usd": pytest.approx(expected["cost_usd"], rel=1e-9)}]
    filtered = httpx.get(receipt.url("/admin/usage"), params={"tenant": "tpm"},
                         headers=auth(receipt.keys["admin"]), timeout=10)
    assert filtered.status_code == 200 and filtered.json()["data"] == []
    future = httpx.get(receipt.url("/admin/usage"), params={"since": "2100-01-01"},
                       headers=auth(receipt.keys["admin"]), timeout=10)
    assert future.status_code == 200 and future.json()["data"] == []
    bad = httpx.get(receipt.url("/admin/usage"), params={"since": "yesterday-ish"},
                    headers=auth(receipt.keys["admin"]), timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
    assert httpx.get(receipt.url("/admin/usage"), headers=auth(receipt.keys["alice"]), timeout=10).status_code == 403


def test_log_prompts_puts_the_user_text_in_the_log(receipt: ReceiptServer) -> None:
    # The stop-string request above carried SECRET in its message; this server has --log-prompts.
    lines = []
    for line in receipt.server.log().splitlines():
        at = line.find('request {"event": "request_finished"')
        if at >= 0:
            lines.append(json.loads(line[at + len("request "):]))
    ours = [line for line in lines if line["request_id"] == "led-stopped"]
    assert len(ours) == 1
    assert any(SECRET in prompt for prompt in ours[0]["prompts"]), ours[0]
    assert isinstance(ours[0]["completions"], list) and len(ours[0]["completions"]) == 1
    # One structured line per billed request.
    billed = {r.request_id for r in receipt.records()}
    assert billed <= {line["request_id"] for line in lines}


# --- 6. crash durability (kills the module's server: keep it last) ----------------------------


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_every_completed_response_survives_a_kill_9(receipt: ReceiptServer) -> None:
    clients, per_client = 8, 40
    completed: dict[str, dict[str, Any]] = {}
    sent: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()
    deadline = time.monotonic() + 60

    def client_loop(c: int) -> None:
        with httpx.Client(timeout=10, headers=auth(receipt.keys["alice"])) as client:
            for j in range(per_client):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                request_id = f"crash-{c}-{j}"
                with lock:
                    sent.add(request_id)
                try:
                    response = client.post(receipt.url("/v1/completions"), headers={"X-Request-Id": request_id},
                                           json={"model": MODEL, "prompt": [3000 + c, 3001 + j, 3002],
                                                 "max_tokens": 3, "ignore_eos": True})
                except httpx.HTTPError:
                    return  # the server is gone
                if response.status_code == 200:
                    with lock:
                        completed[request_id] = response.json()["usage"]

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(clients)]
    for thread in threads:
        thread.start()
    try:
        assert wait_until(lambda: len(completed) >= 24, timeout=45, interval=0.05), len(completed)
        pid = receipt.server.process.pid
        children = _children(pid)  # the engine (and multiprocessing's resource tracker)
        os.kill(pid, signal.SIGKILL)
        with lock:
            done_before_kill = dict(completed)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert receipt.server.process.wait(timeout=10) == -signal.SIGKILL
    with lock:
        done = dict(completed)
    # A response can only have completed before the kill; whatever arrived is in `done`.
    assert len(done) >= len(done_before_kill) >= 24

    conn = sqlite3.connect(receipt.db)
    try:
        rows = conn.execute(
            "SELECT request_id, status, prompt_tokens, completion_tokens FROM usage WHERE request_id LIKE 'crash-%'"
        ).fetchall()
    finally:
        conn.close()
    by_id: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_id.setdefault(row[0], []).append(row)
    missing = sorted(set(done) - set(by_id))
    assert not missing, f"{len(missing)} of {len(done)} completed responses have no ledger row: {missing[:10]}"
    for request_id, usage in done.items():
        assert len(by_id[request_id]) == 1, by_id[request_id]
        _, status, prompt_tokens, completion_tokens = by_id[request_id][0]
        assert status == "finished"
        assert (prompt_tokens, completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 3)
    assert set(by_id) <= sent  # nothing billed that was not asked for

"""``tokenline router --upstream URL,kind=openai``: a real ``tokenline serve`` treated as a hosted
API (text in, text out, no token ids), a keys file in front, through the official client.

Checked: chat streaming and not, completions, the served name in place of the upstream's, usage in
the response, in the router's ledger (SQLite, with cost) and on its /metrics; an upstream 4xx passed
through with its status and shape; a bad router key refused before any upstream call; a caller that
hangs up mid-stream closes the upstream request; kinds mixed in one router refused.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, free_port, stop, wait_healthy, wait_until
from tests.router.test_router_e2e import _launch
from tokenline.gateway.keys import add_key

MODEL = "SmolLM2-135M-Instruct"
SERVED = "hosted-smol"  # the router's name for the upstream's model: responses must say this one
UPSTREAM_KEY = "upstream-secret"


@dataclass
class Hosted:
    router: Server
    upstream: Server
    key: str
    tmp: Path

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router.api_url, api_key=key or self.key, max_retries=0, timeout=60)

    def rows(self, db: Path, where: str = "1", args: tuple = ()) -> list[sqlite3.Row]:
        with sqlite3.connect(db) as conn:
            conn.row_factory = sqlite3.Row
            return conn.execute(f"SELECT * FROM usage WHERE status != 'in_flight' AND {where}", args).fetchall()

    def router_rows(self, response_id: str) -> list[sqlite3.Row]:
        return self.rows(self.tmp / f"usage-{self.router.base_url.rsplit(':', 1)[1]}.sqlite3",
                         "response_id = ?", (response_id,))

    def upstream_row_count(self) -> int:
        return len(self.rows(self.tmp / f"usage-{self.upstream.base_url.rsplit(':', 1)[1]}.sqlite3"))


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Hosted]:
    tmp = tmp_path_factory.mktemp("hosted")
    keys = tmp / "keys.toml"
    key = add_key(keys, "acme")
    prices = tmp / "prices.toml"
    prices.write_text(f'[models."{SERVED}"]\ninput = 1.0\noutput = 2.0\n')
    upstream = _launch(tmp, "serve", free_port(), "--kv-cache-memory", "0.25", "--max-tokens-cap", "64",
                       "--api-key", UPSTREAM_KEY, "--metrics-auth", "none")
    router = None
    try:
        wait_healthy(upstream)
        router = _launch(tmp, "router", free_port(), "--model", MODEL, "--served-model-name", SERVED,
                         "--upstream", f"{upstream.base_url},kind=openai", "--upstream-api-key", UPSTREAM_KEY,
                         "--keys", str(keys), "--prices", str(prices), "--metrics-auth", "none",
                         "--health-interval", "0.5")
        wait_healthy(router)
        yield Hosted(router, upstream, key, tmp)
    finally:
        if router is not None:
            stop(router.process)
        stop(upstream.process)


def _wait_row(hosted: Hosted, response_id: str) -> sqlite3.Row:
    assert wait_until(lambda: len(hosted.router_rows(response_id)) == 1, timeout=10), response_id
    return hosted.router_rows(response_id)[0]


def test_chat_not_streamed_reports_the_served_name_and_bills_the_upstream_usage(hosted: Hosted) -> None:
    response = hosted.client().chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0)
    assert response.model == SERVED
    assert response.choices[0].message.content
    assert response.usage is not None and response.usage.completion_tokens > 0
    row = _wait_row(hosted, response.id)
    assert (row["tenant"], row["model"], row["status"]) == ("acme", SERVED, "finished")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (response.usage.prompt_tokens,
                                                                response.usage.completion_tokens)
    expected = (row["prompt_tokens"] * 1.0 + row["completion_tokens"] * 2.0) / 1e6
    assert row["cost_usd"] == pytest.approx(expected)


def test_chat_streamed_passes_chunks_through_and_drops_the_forced_usage_chunk(hosted: Hosted) -> None:
    before = hosted.router.metrics()
    chunks = list(hosted.client().chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0,
        stream=True))
    assert all(c.model == SERVED for c in chunks)
    assert all(c.usage is None for c in chunks)  # the caller did not ask for usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    row = _wait_row(hosted, chunks[0].id)
    assert row["status"] == "finished" and row["completion_tokens"] == 12
    after = hosted.router.metrics()
    for family in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                   "vllm:inter_token_latency_seconds_count"):
        assert after[family] > before.get(family, 0.0), family
    def finished_by_length(samples: dict[str, float]) -> float:
        return sum(v for k, v in samples.items()
                   if k.startswith("vllm:request_success_total{") and 'finished_reason="length"' in k)

    assert finished_by_length(after) == finished_by_length(before) + 1, [k for k in after if "success" in k]


def test_streamed_usage_is_passed_on_when_the_caller_asks(hosted: Hosted) -> None:
    chunks = list(hosted.client().chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 5 and chunks[-1].choices == []
    assert _wait_row(hosted, chunks[0].id)["completion_tokens"] == 5


def test_completions_streamed_and_not(hosted: Hosted) -> None:
    client = hosted.client()
    full = client.completions.create(model=SERVED, prompt="The sky is", max_tokens=6, temperature=0)
    assert full.model == SERVED and full.choices[0].text and full.usage.completion_tokens == 6
    streamed = list(client.completions.create(model=SERVED, prompt="The sky is", max_tokens=6, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full.choices[0].text
    assert _wait_row(hosted, full.id)["completion_tokens"] == 6
    assert _wait_row(hosted, streamed[0].id)["completion_tokens"] == 6


def test_an_upstream_4xx_reaches_the_caller_with_its_status_and_shape(hosted: Hosted) -> None:
    # The router has no cap; the upstream allows at most 64: the refusal is the upstream's own.
    with pytest.raises(openai.BadRequestError) as info:
        hosted.client().chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=500)
    assert info.value.status_code == 400
    error = info.value.body
    assert isinstance(error, dict) and error.get("param") == "max_tokens" and "64" in error["message"]


def test_a_bad_router_key_is_refused_before_any_upstream_call(hosted: Hosted) -> None:
    served = hosted.upstream_row_count()
    with pytest.raises(openai.AuthenticationError):
        hosted.client("sk-not-a-key").chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    time.sleep(0.5)
    assert hosted.upstream_row_count() == served


def test_a_caller_that_hangs_up_closes_the_upstream_request(hosted: Hosted) -> None:
    running = "vllm:num_requests_running"
    body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 64, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {hosted.key}"}
    seen = 0
    with httpx.stream("POST", f"{hosted.router.api_url}/completions", json=body, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                response_id = line.split('"id":"', 1)[1].split('"', 1)[0]
            if seen == 3:
                assert hosted.upstream.metrics()[running] == 1
                break
    assert wait_until(lambda: hosted.upstream.metrics()[running] == 0, timeout=10)
    row = _wait_row(hosted, response_id)
    assert row["status"] == "cancelled" and 3 <= row["completion_tokens"] < 64


def test_mixing_kinds_in_one_router_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(  # noqa: PLW1510 - the exit status is what is checked
        [sys.executable, "-m", "tokenline.cli", "router", "--upstream", "http://127.0.0.1:9,kind=openai",
         "--upstream", "http://127.0.0.1:10"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "kinds mixed" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_responses_api_is_refused_with_a_400_naming_the_routes_that_pass_through(hosted: Hosted) -> None:
    response = httpx.post(f"{hosted.router.api_url}/responses", json={"model": SERVED, "input": "Hi"},
                          headers={"Authorization": f"Bearer {hosted.key}"}, timeout=30)
    assert response.status_code == 400, response.text
    assert "/v1/chat/completions" in response.json()["error"]["message"]


def test_upstream_options_parse_and_bad_ones_are_refused() -> None:
    from tokenline.router.remote_client import parse_upstream

    spec = parse_upstream("https://api.example.com/v1,kind=openai,model=gpt-4o-mini")
    assert (spec.url, spec.kind, spec.model) == ("https://api.example.com", "openai", "gpt-4o-mini")
    assert parse_upstream("http://10.0.0.5:8000,kind=vllm").kind == "tokenline"  # both speak token ids
    for bad in ("http://h:1,kind=grpc", "http://h:1,model=x", "http://h:1,kind=openai,kv-events=tcp://h:2"):
        with pytest.raises(ValueError):
            parse_upstream(bad)


def test_a_refused_connection_before_the_first_byte_is_retried_on_another_upstream(hosted: Hosted) -> None:
    tmp = hosted.tmp
    doomed = _launch(tmp, "serve", free_port(), "--kv-cache-memory", "0.25", "--api-key", UPSTREAM_KEY)
    router = None
    try:
        wait_healthy(doomed)
        # Health checks every 60 s: after the first pair, only a request finds the dead upstream.
        router = _launch(tmp, "router", free_port(), "--model", MODEL, "--routing-policy", "round_robin",
                         "--upstream", f"{hosted.upstream.base_url},kind=openai",
                         "--upstream", f"{doomed.base_url},kind=openai", "--upstream-api-key", UPSTREAM_KEY,
                         "--health-interval", "60")
        wait_healthy(router)
        name = doomed.base_url.removeprefix("http://")
        assert wait_until(lambda: router.metrics().get(f'tokenline:router_upstream_healthy{{upstream="{name}"}}') == 1)
        doomed.process.kill()
        doomed.process.wait(timeout=10)
        client = openai.OpenAI(base_url=router.api_url, api_key="unused", max_retries=0, timeout=60)
        for _ in range(3):
            answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=3)
            assert answer.usage is not None and answer.usage.completion_tokens == 3
        samples = router.metrics()
        assert samples[f'tokenline:router_retries_total{{upstream="{name}"}}'] == 1
        assert samples[f'tokenline:router_upstream_healthy{{upstream="{name}"}}'] == 0
    finally:
        if router is not None:
            stop(router.process)
        stop(doomed.process)

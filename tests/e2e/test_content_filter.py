"""Safety filters through a real server: a keys file where tenant A has a blocklist, B has none,
C takes the server's default (``--content-filter``: a moderation service, run here on 127.0.0.1)
and D's moderation service is down (fail-closed). Refused input is a 400 ``content_filter`` with
no engine work; flagged output ends the stream with ``finish_reason: "content_filter"``, the
engine request aborted and its tokens billed; every decision is in the trace, the ledger and
``/metrics``.

The output filter trips on "blue": greedy SmolLM2 (float32) answers "What colour is the sky?"
with "The sky is a beautiful shade of blue. …", as tenant B's unfiltered answer shows.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, free_port, start_server, wait_until
from tests.e2e.test_edge import assert_openai_error
from tests.gateway.moderation_server import ModerationServer, moderation_server
from tokenline.gateway.keys import hash_key

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"a": "tl-filter-a", "b": "tl-filter-b", "c": "tl-filter-c", "d": "tl-filter-d", "e": "tl-filter-e",
        "ops": "tl-filter-ops"}
SKY = [{"role": "user", "content": "What colour is the sky?"}]
BEFORE_BLUE = "The sky is a beautiful shade of "  # greedy text up to the flagged word (8 tokens)
MAX_TOKENS = 24
DECISIONS = "tokenline:content_filter_decisions_total"


@dataclass
class FilterServer:
    server: Server
    moderation: ModerationServer
    ledger: Path

    def post(self, tenant: str, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        return httpx.post(f"{self.server.base_url}{path}", json=body, headers=headers, timeout=120)

    def sdk(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.api_url, api_key=KEYS[tenant], max_retries=0, timeout=120)

    def rows(self, **where: str) -> list[dict[str, Any]]:
        clause = " AND ".join(f"{k} = ?" for k in where)
        with sqlite3.connect(self.ledger) as db:
            db.row_factory = sqlite3.Row
            # A journaled row still in flight is not a receipt yet: only completed rows count.
            return [dict(r) for r in db.execute(f"SELECT * FROM usage WHERE {clause} AND status != 'in_flight'",
                                                tuple(where.values()))]

    def metrics(self) -> dict[str, float]:
        """/metrics samples, read with the admin key: with keys configured, /metrics is not for everyone."""
        return self.server.metrics(KEYS["ops"])

    def events(self, tenant: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """A streamed answer's ``data:`` payloads (Responses API: each event's data)."""
        with httpx.stream("POST", f"{self.server.base_url}{path}", json={**body, "stream": True}, timeout=120,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as response:
            assert response.status_code == 200, response.read()
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return [json.loads(line) for line in lines if line != "[DONE]"]

    def trace(self, tenant: str, request_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.server.base_url}/v1/requests/{request_id}/trace",
                             headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()


def decisions(server: FilterServer, filter_: str, stage: str, verdict: str) -> float:
    return server.metrics().get(f'{DECISIONS}{{filter="{filter_}",stage="{stage}",verdict="{verdict}"}}', -1.0)


def engine_work(server: FilterServer) -> tuple[float, ...]:
    """Counters that move whenever the engine takes a request."""
    m = server.metrics()
    finished = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total{"))
    return m["vllm:prompt_tokens_total"], m["vllm:prefix_cache_queries_total"], finished


@pytest.fixture(scope="module")
def filtered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FilterServer]:
    tmp = tmp_path_factory.mktemp("content-filter")
    with moderation_server() as moderation, pytest.MonkeyPatch.context() as env:
        env.setenv("TL_TEST_MODERATION_KEY", "sk-moderation")  # the server reads it per check
        (tmp / "filters.toml").write_text(f"""
[[content_filter]]
type = "moderation"
name = "house-moderation"
url = "{moderation.url}/v1/moderations"
model = "omni-moderation-latest"
api_key_env = "TL_TEST_MODERATION_KEY"
stages = ["input"]
""")
        (tmp / "keys.toml").write_text(f"""
[[tenant]]
name = "a"
key_sha256 = "{hash_key(KEYS["a"])}"
[[tenant.content_filter]]
type = "blocklist"
name = "house-words"
words = ["xylophone", "blue"]

[[tenant]]
name = "b"
key_sha256 = "{hash_key(KEYS["b"])}"
content_filter = []

[[tenant]]
name = "c"
key_sha256 = "{hash_key(KEYS["c"])}"

[[tenant]]
name = "e"
key_sha256 = "{hash_key(KEYS["e"])}"
[[tenant.content_filter]]
type = "blocklist"
name = "house-phrases"
words = ["shade of blue"]
stages = ["output"]

[[tenant]]
name = "ops"
key_sha256 = "{hash_key(KEYS["ops"])}"
admin = true
content_filter = []

[[tenant]]
name = "d"
key_sha256 = "{hash_key(KEYS["d"])}"
[[tenant.content_filter]]
type = "moderation"
name = "down-moderation"
url = "http://127.0.0.1:{free_port()}/v1/moderations"
timeout_s = 1.0
""")
        with start_server(tmp, "--dtype", "float32", "--keys", str(tmp / "keys.toml"),
                          "--content-filter", str(tmp / "filters.toml")) as server:
            ledger = next(tmp.glob("usage-*.sqlite3"))
            yield FilterServer(server, moderation, ledger)


def test_every_configured_filter_has_its_series_at_zero(filtered: FilterServer) -> None:
    for filter_, stages in (("house-words", ("input", "output")), ("house-moderation", ("input",)),
                            ("down-moderation", ("input", "output"))):
        for stage in stages:
            for verdict in ("allow", "block", "error"):
                assert decisions(filtered, filter_, stage, verdict) == 0.0, (filter_, stage, verdict)
    assert decisions(filtered, "house-moderation", "output", "allow") == -1.0  # input only


def test_refused_input_is_a_400_before_any_engine_work(filtered: FilterServer) -> None:
    work = engine_work(filtered)
    chat = filtered.post("a", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Play the XYLOPHONE"}],
    })
    error = assert_openai_error(chat, 400, "invalid_request_error", code="content_filter", param="messages")
    assert "house-words" in error["message"] and "XYLOPHONE" not in error["message"]
    completion = filtered.post("a", "/v1/completions", {"model": MODEL, "prompt": "a xylophone", "max_tokens": 4})
    assert_openai_error(completion, 400, "invalid_request_error", code="content_filter", param="prompt")

    assert engine_work(filtered) == work  # nothing reached the engine
    assert decisions(filtered, "house-words", "input", "block") == 2.0
    request_id = chat.headers["x-request-id"]
    trace = filtered.trace("a", request_id)
    assert trace["status"] == "refused"
    assert [(d["stage"], d["filter"], d["verdict"], d["reason"]) for d in trace["content_filter"]] == [
        ("input", "house-words", "block", "word")
    ]
    rows = filtered.rows(tenant="a", status="refused")
    assert len(rows) == 2
    assert {(r["finish_reason"], r["content_filter"], r["prompt_tokens"], r["completion_tokens"]) for r in rows} == {
        ("content_filter", "house-words", 0, 0)
    }


def test_tenant_without_filters_is_served_the_same_input(filtered: FilterServer) -> None:
    response = filtered.post("b", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Play the XYLOPHONE"}],
    })
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_flagged_output_ends_the_stream_with_content_filter(filtered: FilterServer) -> None:
    with filtered.sdk("b") as sdk:  # the unfiltered answer: the word really comes
        free = sdk.chat.completions.create(model=MODEL, messages=SKY, temperature=0, max_tokens=10)
    assert free.choices[0].message.content.startswith(BEFORE_BLUE + "blue")
    assert free.choices[0].finish_reason == "length"

    with filtered.sdk("a") as sdk:
        raw = sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=SKY, temperature=0, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["content_filter"]
    assert text == BEFORE_BLUE
    usage = chunks[-1].usage
    # The engine request was aborted: it produced the tokens up to the word (billed), not all.
    assert 0 < usage.completion_tokens < MAX_TOKENS, usage
    assert wait_until(lambda: filtered.metrics()["vllm:num_requests_running"] == 0)

    [row] = filtered.rows(response_id=chunks[0].id)
    assert (row["status"], row["finish_reason"], row["content_filter"]) == ("finished", "content_filter", "house-words")
    assert row["completion_tokens"] == usage.completion_tokens
    assert decisions(filtered, "house-words", "output", "block") == 1.0
    trace = filtered.trace("a", raw.headers["x-request-id"])
    assert [(d["stage"], d["verdict"]) for d in trace["content_filter"]] == [("input", "allow"), ("output", "block")]


def test_flagged_output_is_truncated_in_a_full_response(filtered: FilterServer) -> None:
    response = filtered.post("a", "/v1/chat/completions",
                             {"model": MODEL, "messages": SKY, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (BEFORE_BLUE, "content_filter")
    assert 0 < body["usage"]["completion_tokens"] < MAX_TOKENS


def test_default_moderation_service_refuses_what_it_flags(filtered: FilterServer) -> None:
    moderation = filtered.moderation
    moderation.seen.clear()
    work = engine_work(filtered)
    refused = filtered.post("c", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "something Forbidden"}],
    })
    assert_openai_error(refused, 400, "invalid_request_error", code="content_filter", param="messages")
    assert engine_work(filtered) == work
    [seen] = moderation.seen
    assert seen["auth"] == "Bearer sk-moderation"
    assert seen["body"] == {"input": ["something Forbidden"], "model": "omni-moderation-latest"}
    trace = filtered.trace("c", refused.headers["x-request-id"])
    assert trace["content_filter"][0]["reason"] == "violence"

    served = filtered.post("c", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "something kind"}],
    })
    assert served.status_code == 200, served.text
    assert decisions(filtered, "house-moderation", "input", "allow") == 1.0


def test_unreachable_moderation_fails_closed_with_a_503(filtered: FilterServer) -> None:
    work = engine_work(filtered)
    response = filtered.post("d", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}],
    })
    error = assert_openai_error(response, 503, "service_unavailable", code="content_filter_unavailable")
    assert "down-moderation" in error["message"]
    assert response.headers["retry-after"]
    assert engine_work(filtered) == work
    assert decisions(filtered, "down-moderation", "input", "error") == 1.0
    [row] = filtered.rows(tenant="d")
    assert (row["status"], row["content_filter"]) == ("refused", "down-moderation")


def test_responses_api_is_filtered_alike(filtered: FilterServer) -> None:
    refused = filtered.post("a", "/v1/responses", {"model": MODEL, "input": "Play the xylophone", "max_output_tokens": 4})
    assert_openai_error(refused, 400, "invalid_request_error", code="content_filter", param="input")
    response = filtered.post("a", "/v1/responses", {
        "model": MODEL, "input": SKY, "temperature": 0, "max_output_tokens": MAX_TOKENS, "store": False,
    })
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "content_filter"})
    [message] = [item for item in body["output"] if item["type"] == "message"]
    assert message["content"][0]["text"] == BEFORE_BLUE


def test_cut_text_leaves_no_logprobs_and_no_token_ids(filtered: FilterServer) -> None:
    """The tokens of text a filter cut never leave the server: not as logprobs, not as token ids
    (which /detokenize would spell), in full answers and streams of both APIs alike. The token
    " blue" straddles the cut (its space is shown, its word cut): it is withheld whole."""
    tokens = BEFORE_BLUE.rstrip()
    chat = {"model": MODEL, "messages": SKY, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True,
            "top_logprobs": 1}
    full = filtered.post("a", "/v1/chat/completions", chat).json()["choices"][0]
    assert (full["message"]["content"], full["finish_reason"]) == (BEFORE_BLUE, "content_filter")
    assert "".join(t["token"] for t in full["logprobs"]["content"]) == tokens

    chunks = [c["choices"][0] for c in filtered.events("a", "/v1/chat/completions", chat) if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == BEFORE_BLUE
    streamed = [t["token"] for c in chunks if c.get("logprobs") for t in c["logprobs"]["content"]]
    assert "".join(streamed) == tokens

    # The same prompt as token ids: completions with logprobs and return_token_ids.
    prompt = filtered.post("a", "/tokenize", {"model": MODEL, "messages": SKY}).json()["tokens"]
    completion = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 1,
                  "return_token_ids": True}
    [choice] = filtered.post("a", "/v1/completions", completion).json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (BEFORE_BLUE, "content_filter")
    assert "".join(choice["logprobs"]["tokens"]) == tokens
    spelled = filtered.post("a", "/detokenize", {"model": MODEL, "tokens": choice["token_ids"]}).json()["prompt"]
    assert spelled == tokens

    chunks = [c["choices"][0] for c in filtered.events("a", "/v1/completions", completion) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == BEFORE_BLUE
    assert "".join(t for c in chunks if c.get("logprobs") for t in c["logprobs"]["tokens"]) == tokens
    ids = [i for c in chunks for i in c.get("token_ids") or []]
    assert filtered.post("a", "/detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"] == tokens


def test_a_listed_phrase_never_streams_in_part(filtered: FilterServer) -> None:
    """"shade of blue" arrives as three tokens: the stream holds back the longest listed phrase less
    one character (--filter-holdback auto), so " shade" and " of" are not sent before "blue" trips
    the filter: the stream says exactly what the full answer says."""
    before = BEFORE_BLUE.removesuffix("shade of ")
    chat = {"model": MODEL, "messages": SKY, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True}
    full = filtered.post("e", "/v1/chat/completions", chat).json()["choices"][0]
    assert (full["message"]["content"], full["finish_reason"]) == (before, "content_filter")
    chunks = [c["choices"][0] for c in filtered.events("e", "/v1/chat/completions", chat) if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == before
    assert "".join(t["token"] for c in chunks if c.get("logprobs") for t in c["logprobs"]["content"]) == before.rstrip()
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["content_filter"]
    events = filtered.events("e", "/v1/responses", {"model": MODEL, "input": SKY, "temperature": 0,
                                                    "max_output_tokens": MAX_TOKENS, "store": False})
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == before
    assert events[-1]["response"]["incomplete_details"] == {"reason": "content_filter"}

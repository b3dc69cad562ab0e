"""``tokenline router`` in front of two real ``tokenline serve`` upstreams, through the official client.

The router renders, tokenizes and detokenizes; the upstreams get token ids over vLLM's streaming
completions protocol (``return_token_ids``). Checked here: chat, streaming, ``n=2``, stop strings
(the router's), usage with cached tokens, an upstream's 400 passed through, prefix affinity seen in
the per-upstream series, and one upstream killed under load and restarted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import (
    Server,
    free_port,
    stop,
    wait_healthy,
    wait_until,
)

MODEL = "SmolLM2-135M-Instruct"
UPSTREAM_ARGS = ("--max-tokens-cap", "64")  # the router has none: a larger max_tokens is the upstream's 400


def _launch(tmp: Path, command: str, port: int, *args: str) -> Server:
    log_path = tmp / f"{command}-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenline.cli", command, "--host", "127.0.0.1", "--port", str(port),
             "--usage-db", str(tmp / f"usage-{port}.sqlite3"), *args],
            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    return Server(f"http://127.0.0.1:{port}", process, log_path)


def _upstream(tmp: Path, port: int) -> Server:
    return _launch(tmp, "serve", port, "--kv-cache-memory", "0.25", *UPSTREAM_ARGS)


@dataclass
class Fleet:
    router: Server
    upstreams: list[Server]
    tmp: Path
    extra: list[Server] = field(default_factory=list)

    def name(self, i: int) -> str:
        return self.upstreams[i].base_url.removeprefix("http://")

    def series(self, family: str, i: int, **labels: str) -> float:
        """The router's sample of ``family`` for upstream ``i`` (and ``labels``); 0 when absent."""
        wanted = [f'upstream="{self.name(i)}"', *(f'{k}="{v}"' for k, v in labels.items())]
        for key, value in self.router.metrics().items():
            if key.startswith(family + "{") and all(w in key for w in wanted):
                return value
        return 0.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("router")
    ports = [free_port(), free_port()]
    upstreams = [_upstream(tmp, port) for port in ports]
    fleet = Fleet(None, upstreams, tmp)  # type: ignore[arg-type]
    try:
        for upstream in upstreams:
            wait_healthy(upstream)
        fleet.router = _launch(tmp, "router", free_port(), "--health-interval", "0.5", "--unhealthy-after", "2",
                               *(a for u in upstreams for a in ("--upstream", u.base_url)))
        wait_healthy(fleet.router)
        assert wait_until(lambda: all(fleet.series("tokenline:router_upstream_healthy", i) == 1 for i in (0, 1)))
        yield fleet
    finally:
        with ExitStack() as stack:
            for server in [fleet.router, *fleet.upstreams, *fleet.extra]:
                if server is not None:
                    stack.callback(stop, server.process)


def _client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.router.api_url, api_key="none", max_retries=0, timeout=120)


def test_chat_streaming_n2_stop_strings_and_token_prompts_through_the_router(fleet: Fleet) -> None:
    client = _client(fleet)
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.content and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 10

    texts = {0: "", 1: ""}
    usage = None
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=2, seed=3,
                                                temperature=1.0, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert all(texts.values()) and set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens <= 20

    # Greedy: the stop string cuts the router's text exactly where the text without it has it.
    plain = client.completions.create(model=MODEL, prompt="The alphabet: a, b, c, d,", max_tokens=16, temperature=0)
    text = plain.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.completions.create(model=MODEL, prompt="The alphabet: a, b, c, d,", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"

    ids = client.completions.create(model=MODEL, prompt=[1, 504, 3458, 28], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens >= 1


def test_tokenline_returns_token_ids_as_vllm_does_and_constraints_pass_through(fleet: Fleet) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    full = httpx.post(f"{fleet.upstreams[0].api_url}/completions", json=body, timeout=60).json()["choices"][0]
    assert len(full["token_ids"]) == 6 and full["prompt_token_ids"]
    chunks = []
    with httpx.stream("POST", f"{fleet.upstreams[0].api_url}/completions", json={**body, "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])  # only the first chunk carries the prompt
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"]  # deltas add up
    assert "token_ids" not in httpx.post(f"{fleet.upstreams[0].api_url}/completions", json={
        **body, "return_token_ids": False}, timeout=60).json()["choices"][0]
    # A constraint is the upstream's to enforce: it travels as vLLM's structured_outputs.
    reply = _client(fleet).chat.completions.create(
        model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Is water wet?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].message.content in ("yes", "no")


def test_an_upstreams_400_reaches_the_caller_as_a_400(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        _client(fleet).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=100)
    assert "max_tokens" in str(error.value)
    before = fleet.series("tokenline:router_errors_total", 0) + fleet.series("tokenline:router_errors_total", 1)
    assert before == 0  # the request's own fault: no upstream is blamed, nothing retried


def test_the_same_long_prompt_lands_on_the_same_upstream_and_hits_its_cache(fleet: Fleet) -> None:
    client = _client(fleet)
    system = "You are a librarian. " + " ".join(f"Rule {k}: shelve volume {k} by author." for k in range(40))
    before = [fleet.series("tokenline:router_requests_total", i) for i in (0, 1)]
    cached = []
    for question in ("Where is volume 3?", "Where is volume 7?", "Where is volume 9?"):
        reply = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    after = [fleet.series("tokenline:router_requests_total", i) for i in (0, 1)]
    landed = [a - b for a, b in zip(after, before)]
    assert sorted(landed) == [0, 3], landed
    assert cached[0] < cached[1] and min(cached[1:]) >= 300  # the shared system prompt came from the cache
    target = landed.index(3)
    assert fleet.series("tokenline:router_decisions_total", target, reason="prefix") >= 2
    predicted = fleet.series("tokenline:router_prefix_hit_tokens_total", target, source="predicted")
    reported = fleet.series("tokenline:router_prefix_hit_tokens_total", target, source="reported")
    assert predicted >= 600 and reported >= sum(cached[1:])


@dataclass
class Outcome:
    started: bool = False  # a chunk arrived (the role chunk comes with the first tokens)
    error: str | None = None
    clean: bool = True  # the error was an error event, not a broken connection


def _stream_one(client: openai.OpenAI, k: int) -> Outcome:
    outcome = Outcome()
    try:
        for chunk in client.chat.completions.create(
                model=MODEL, max_tokens=24, temperature=1.0, seed=k, stream=True,
                # Distinct words: the chat template's shared start is too small a part for prefix
                # affinity, so the load spreads over both upstreams.
                messages=[{"role": "user", "content": f"Story {k}: " + " ".join(f"fox{k}x{j}" for j in range(30))}],
                extra_body={"ignore_eos": True}):
            if chunk.choices:  # the first event: the router already had tokens from an upstream
                outcome.started = True
    except openai.APIError as exc:  # an HTTP status, or an error event inside the stream (its body)
        outcome.error = str(exc)
        outcome.clean = isinstance(exc.body, dict)
    except Exception as exc:  # noqa: BLE001 - a broken connection is not a clean end
        outcome.error, outcome.clean = repr(exc), False
    return outcome


def _kill_tree(server: Server) -> None:
    parent = psutil.Process(server.process.pid)
    victims = [parent, *parent.children(recursive=True)]
    for process in victims:
        process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=10)
    psutil.wait_procs(victims, timeout=10)


def test_killing_an_upstream_under_load_retries_unstarted_requests_and_it_rejoins(fleet: Fleet) -> None:
    client = _client(fleet)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    done = threading.Event()  # set a little after the kill: workers start no new request then
    counter = iter(range(10_000))

    def worker() -> None:
        while not done.is_set():
            with lock:
                k = next(counter)
            outcome = _stream_one(client, k)
            with lock:
                outcomes.append(outcome)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for thread in workers:
        thread.start()
    try:
        # Kill the first upstream seen streaming: a request there has its first token and no end.
        streaming = {}

        def busy() -> bool:
            for i, upstream in enumerate(fleet.upstreams):
                values = upstream.metrics()
                streaming[i] = (values.get("vllm:time_to_first_token_seconds_count", 0)
                                - values.get("vllm:e2e_request_latency_seconds_count", 0))
            return any(v >= 1 for v in streaming.values())

        assert wait_until(busy, timeout=90, interval=0.05), fleet.router.log()[-3000:]
        victim = max(streaming, key=streaming.get)
        victim_server = fleet.upstreams[victim]
        _kill_tree(victim_server)
        killed_at = time.monotonic()
        assert wait_until(lambda: fleet.series("tokenline:router_upstream_healthy", victim) == 0, timeout=5)
        out_within = time.monotonic() - killed_at
        requests_then = fleet.series("tokenline:router_requests_total", victim)
        with lock:
            finished_at_kill = len(outcomes)
        # The load goes on until the streams in flight at the kill (retried or cut) have ended.
        wait_until(lambda: len(outcomes) >= finished_at_kill + 4, timeout=90)
    finally:
        done.set()
        deadline = time.monotonic() + 180  # a loaded 2-core box can make one stream slow
        for thread in workers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in workers), fleet.router.log()[-3000:]
    assert out_within <= 5.0
    # Nothing went to the dead upstream once it was out: new requests all go to the other one.
    survivor = 1 - victim
    survivor_before = fleet.series("tokenline:router_requests_total", survivor)
    for k in range(3):
        client.completions.create(model=MODEL, prompt=f"After the kill, prompt {k}", max_tokens=2)
    assert fleet.series("tokenline:router_requests_total", victim) == requests_then
    assert fleet.series("tokenline:router_requests_total", survivor) == survivor_before + 3

    failed_unstarted = [o for o in outcomes if o.error and not o.started]
    failed_started = [o for o in outcomes if o.error and o.started]
    assert not failed_unstarted, [o.error for o in failed_unstarted]
    assert failed_started, "no stream was on the killed upstream: the kill came too late"
    assert all(o.clean and "engine failed" in (o.error or "") for o in failed_started), failed_started
    assert len(outcomes) - len(failed_started) >= 4  # the load went on on the other upstream
    assert fleet.router.process.poll() is None

    # Restarted on the same address, it is healthy again and takes new requests.
    restarted = _upstream(fleet.tmp, int(victim_server.base_url.rsplit(":", 1)[1]))
    fleet.extra.append(restarted)
    wait_healthy(restarted)
    assert wait_until(lambda: fleet.series("tokenline:router_upstream_healthy", victim) == 1, timeout=10)
    before = fleet.series("tokenline:router_requests_total", victim)
    for k in range(8):
        client.completions.create(model=MODEL, prompt=f"Fresh prompt number {k} about rivers", max_tokens=2)
        if fleet.series("tokenline:router_requests_total", victim) > before:
            break
    assert fleet.series("tokenline:router_requests_total", victim) > before
    assert httpx.get(f"{fleet.router.base_url}/health", timeout=5).json()["status"] == "ok"


def test_sigterm_drains_a_stream_in_flight_and_exits_cleanly(fleet: Fleet) -> None:
    """Last in the module: it stops the router."""
    client = _client(fleet)
    stream = client.completions.create(model=MODEL, prompt="Tell me about the sea", max_tokens=16, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    fleet.router.process.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in [first, *rest])
    assert fleet.router.process.wait(timeout=60) == 0

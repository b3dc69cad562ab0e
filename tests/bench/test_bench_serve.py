"""``tokenline bench serve`` against a fake OpenAI-compatible streaming server with known timings."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenline.bench.prompts import make_prompts, ordinary_token_ids
from tokenline.bench.results import BenchServeReport, percentile
from tokenline.bench.serve import BenchServeConfig, run_bench_serve
from tokenline.cli import main as cli_main

FIRST_DELAY = 0.2  # seconds before the first token
CHUNK_DELAY = 0.03  # seconds between tokens
SPECIAL_IDS = [0, 1]
VOCAB = 64


@dataclass
class FakeState:
    first_delay: float = FIRST_DELAY
    chunk_delay: float = CHUNK_DELAY
    send_usage: bool = True
    held_first: bool = False  # the first token's text is held back (half a character): an empty chunk
    fail_ordinals: set[int] = field(default_factory=set)  # arrival ordinals answered with HTTP 500
    arrivals: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    generation: int = 0  # bumped by reset, so a stream cut off in an earlier test can't skew the counts

    def reset(self, **settings: Any) -> None:
        generation = self.generation + 1
        self.__init__(**settings)  # type: ignore[misc]
        self.generation = generation


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        ordinal = state.arrivals
        state.arrivals += 1
        state.bodies.append(body)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        if ordinal in state.fail_ordinals:
            state.in_flight -= 1
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        n = int(body["max_tokens"])

        def chunk(text: str, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": None}
            # Python's default separators (", " and ": "), unlike vLLM's compact JSON: both must parse.
            return f"data: {json.dumps({'id': 'x', 'choices': [choice], 'usage': None})}\n\n"

        generation = state.generation

        async def stream() -> AsyncIterator[str]:
            left = True
            try:
                if chat:
                    yield chunk("", role=True)  # the role announcement is not the first token
                await asyncio.sleep(state.first_delay)
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.chunk_delay)
                    yield chunk("" if state.held_first and i == 0 else f" t{i}")
                if state.send_usage:
                    usage = {"prompt_tokens": len(body.get("prompt") or []) or 1, "completion_tokens": n,
                             "total_tokens": n + (len(body.get("prompt") or []) or 1)}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                # Leave before [DONE]: once the client sees it, it may send its next request.
                state.in_flight -= 1
                left = False
                yield "data: [DONE]\n\n"
            finally:
                if left and state.generation == generation:
                    state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held by us, so no other process can take it first
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny word-level tokenizer: ids 0 and 1 special, 2..63 ordinary."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w2"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok")
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}))
    return path


def run(config: BenchServeConfig) -> BenchServeReport:
    return asyncio.run(asyncio.wait_for(run_bench_serve(config), timeout=30))


def test_percentile() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 90) == pytest.approx(90.0)
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_prompts_exact_seeded_and_shared_prefix() -> None:
    ordinary = ordinary_token_ids(VOCAB, SPECIAL_IDS)
    a = make_prompts(5, 20, ordinary, seed=1)
    assert a == make_prompts(5, 20, ordinary, seed=1)
    assert a != make_prompts(5, 20, ordinary, seed=2)
    assert all(len(p) == 20 for p in a)
    assert all(t not in SPECIAL_IDS and 0 <= t < VOCAB for p in a for t in p)
    shared = make_prompts(4, 20, ordinary, seed=1, shared_prefix_len=12)
    assert all(len(p) == 20 and p[:12] == shared[0][:12] for p in shared)
    assert len({tuple(p[12:]) for p in shared}) == 4  # the tails differ


def test_bench_serve_against_fake_server(fake_server: tuple[str, FakeState], tokenizer_dir: Path) -> None:
    base_url, state = fake_server
    state.reset(fail_ordinals={1, 6})
    n, c, i, o = 14, 4, 24, 8
    config = BenchServeConfig(base_url=base_url, concurrency=c, num_prompts=n, input_len=i, output_len=o,
                              seed=7, tokenizer_dir=str(tokenizer_dir), shared_prefix_len=10, timeout=20)
    report = run(config)

    # Concurrency: never above C, and reached (the client's own count and the server's agree).
    assert state.max_in_flight == c
    assert report.max_in_flight == c
    # Every request is accounted for: failures are counted, not dropped.
    assert state.arrivals == n
    assert (report.completed, report.failed) == (n - 2, 2)
    assert sum(report.errors.values()) == 2 and all(e.startswith("HTTP 500") for e in report.errors)
    assert report.model == "fake-model"
    assert report.usage_reported == report.completed
    assert report.total_output_tokens == (n - 2) * o
    assert report.total_input_tokens == (n - 2) * i

    # What was sent: exact, seeded token-id prompts with the shared prefix, and the request settings.
    ordinary = ordinary_token_ids(VOCAB, SPECIAL_IDS)
    expected = make_prompts(n, i, ordinary, seed=7, shared_prefix_len=10)
    assert sorted(b["prompt"] for b in state.bodies) == sorted(expected)
    for body in state.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == o and body["ignore_eos"] is True and body["temperature"] == 0
        assert body["model"] == "fake-model"

    # Timings: generous bounds, since the client and server share two busy cores.
    assert FIRST_DELAY * 1000 <= report.ttft_ms["p50"] < (FIRST_DELAY + 0.15) * 1000
    assert CHUNK_DELAY * 1000 * 0.8 <= report.itl_ms["mean"] < (CHUNK_DELAY + 0.03) * 1000
    assert CHUNK_DELAY * 1000 * 0.9 <= report.tpot_ms["p50"] < (CHUNK_DELAY + 0.03) * 1000
    assert report.ttft_ms["p50"] <= report.ttft_ms["p90"] <= report.ttft_ms["p99"]
    expected_e2e = FIRST_DELAY + (o - 1) * CHUNK_DELAY
    assert expected_e2e * 1000 <= report.e2e_ms["p50"] < (expected_e2e + 0.25) * 1000
    # 12 requests of ~0.41 s, 4 at a time: about 3 waves.
    assert 2 * expected_e2e < report.duration_s < 10
    assert report.request_throughput == pytest.approx(report.completed / report.duration_s)
    assert report.output_throughput == pytest.approx((n - 2) * o / report.duration_s)
    table = report.format_table()
    assert "TTFT" in table and "failed" in table and "HTTP 500" in table


def test_no_usage_counts_chunks_and_chat_endpoint(fake_server: tuple[str, FakeState], tokenizer_dir: Path) -> None:
    base_url, state = fake_server
    state.reset(send_usage=False, first_delay=0.05, chunk_delay=0.01)
    config = BenchServeConfig(base_url=base_url, concurrency=2, num_prompts=3, input_len=16, output_len=5,
                              endpoint="chat", model="named", tokenizer_dir=str(tokenizer_dir),
                              extra_body={"response_format": {"type": "json_object"}})
    report = run(config)
    assert (report.completed, report.failed) == (3, 0)
    assert all(body["response_format"] == {"type": "json_object"} for body in state.bodies)
    assert report.usage_reported == 0 and report.total_output_tokens == 15
    assert report.input_len_exact is False and "approximate" in report.format_table()
    for body in state.bodies:
        assert body["model"] == "named"
        (message,) = body["messages"]
        assert message["role"] == "user" and len(message["content"].split()) == 16


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_token_sent_without_text_counts(fake_server: tuple[str, FakeState], tokenizer_dir: Path,
                                          endpoint: str) -> None:
    # A server holding back a token's text (half a character) sends its chunk empty, as vLLM does:
    # the token arrived then, so TTFT ends there and the chunk counts (vLLM's client counts it too).
    base_url, state = fake_server
    state.reset(send_usage=False, held_first=True, first_delay=0.3, chunk_delay=0.2)
    report = run(BenchServeConfig(base_url=base_url, concurrency=1, num_prompts=2, input_len=8, output_len=3,
                                  endpoint=endpoint, tokenizer_dir=str(tokenizer_dir)))
    assert (report.completed, report.failed) == (2, 0)
    assert report.total_output_tokens == 6  # counted by chunks: the empty one is a token
    assert 300 <= report.ttft_ms["p50"] < 450  # not 500: the role chunk is not output, the empty one is
    itl = report.itl_ms["mean"]
    assert itl is not None and 180 <= itl < 300


def test_timeout_fails_requests(fake_server: tuple[str, FakeState], tokenizer_dir: Path) -> None:
    base_url, state = fake_server
    state.reset(first_delay=5.0)
    config = BenchServeConfig(base_url=base_url, concurrency=2, num_prompts=2, input_len=4, output_len=2,
                              tokenizer_dir=str(tokenizer_dir), timeout=0.5)
    start = time.perf_counter()
    report = run(config)
    assert time.perf_counter() - start < 3
    assert (report.completed, report.failed) == (0, 2)
    assert list(report.errors) == ["timeout after 0.5 s"]
    assert report.ttft_ms["p50"] is None and report.request_throughput == 0.0


def test_cli_writes_json(fake_server: tuple[str, FakeState], tokenizer_dir: Path, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    base_url, state = fake_server
    state.reset(first_delay=0.02, chunk_delay=0.005)
    out = tmp_path / "report.json"
    rc = cli_main(["bench", "serve", "--base-url", base_url, "--concurrency", "2", "--num-prompts", "4",
                   "--input-len", "8", "--output-len", "4", "--seed", "3", "--tokenizer-dir", str(tokenizer_dir),
                   "--output-json", str(out)])
    assert rc == 0
    assert "request throughput" in capsys.readouterr().out
    data = json.loads(out.read_text())
    for key in ("base_url", "endpoint", "model", "concurrency", "num_prompts", "input_len", "output_len", "seed",
                "shared_prefix_len", "completed", "failed", "errors", "duration_s", "total_input_tokens",
                "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_e2e_ms", "p50_e2e_ms", "p99_e2e_ms"):
        assert key in data, key
    for metric in ("ttft", "tpot", "itl"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert isinstance(data[f"{stat}_{metric}_ms"], float), (stat, metric)
    assert (data["completed"], data["failed"], data["seed"], data["concurrency"]) == (4, 0, 3, 2)



def test_dataset_prompts_sent_as_text_cycling(fake_server: tuple[str, FakeState], tokenizer_dir: Path,
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base_url, state = fake_server
    state.reset(first_delay=0.02, chunk_delay=0.005)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "def f(x):"}\n\n{"prompt": "Text: a b c"}\n')
    rc = cli_main(["bench", "serve", "--base-url", base_url, "--dataset-path", str(data), "--num-prompts", "5",
                   "--output-len", "3", "--concurrency", "2", "--tokenizer-dir", str(tokenizer_dir),
                   "--extra-body", '{"ignore_eos": false, "stop": ["```"]}'])
    assert rc == 0
    assert "dataset" in capsys.readouterr().out
    assert [b["prompt"] for b in state.bodies].count("def f(x):") == 3  # 5 requests over 2 prompts
    assert sorted({b["prompt"] for b in state.bodies}) == ["Text: a b c", "def f(x):"]
    assert all(b["ignore_eos"] is False and b["stop"] == ["```"] for b in state.bodies)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    assert cli_main(["bench", "serve", "--base-url", base_url, "--dataset-path", str(bad)]) == 2
    assert "bad.jsonl:1: each line must be a JSON object with a string 'prompt'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a dataset path"):
        BenchServeConfig(base_url=base_url, workload="dataset")

def test_wait_healthy_says_when_the_server_exited_or_never_answered() -> None:
    import subprocess
    import sys

    from tokenline.bench.serve import ServerNotReady, wait_healthy

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    with pytest.raises(ServerNotReady, match=r"exited \(0\)"):
        wait_healthy("http://127.0.0.1:9", exited, timeout=30)
    with pytest.raises(ServerNotReady, match="not healthy after 0 s"):
        wait_healthy("http://127.0.0.1:9", timeout=0.2, interval=0.05)

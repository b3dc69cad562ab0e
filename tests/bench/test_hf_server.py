"""bench/peers/hf_server.py: HF transformers behind an OpenAI completions endpoint, as the peers harness
drives it (the official ``openai`` client, token-id prompts, ``ignore_eos``, streamed usage), on the
real default model; and what it says for a model transformers' continuous batching cannot run."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tokenline.bench.ports import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers" / "hf_server.py"
START_TIMEOUT_S = 300.0


def _start(model_dir: Path, mode: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(model_dir), "--port", str(port), "--mode", mode,
                             "--threads", "1", "--kv-cache-gib", "1"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen, url: str) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.5)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def cb_server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("hf_cb") / "server.log"
    proc, url = _start(default_model_dir, "cb", log)
    try:
        assert _wait(proc, url), log.read_text()[-3000:]
        yield url
    finally:
        _stop(proc)


def test_continuous_batching_streams_token_prompts_to_max_tokens_with_usage(cb_server: str) -> None:
    client = openai.OpenAI(base_url=cb_server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(model=model, prompt=[1, 2, 3, 4, 5, 6], max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (6, 7)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1


def test_concurrent_text_requests_are_batched_and_deterministic(cb_server: str) -> None:
    client = openai.OpenAI(base_url=cb_server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    from concurrent.futures import ThreadPoolExecutor

    def once(_: int) -> str:
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage is not None and out.usage.completion_tokens == 5
        return out.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(once, range(4)))
    assert len(set(texts)) == 1 and texts[0]


def test_bad_requests_get_the_openai_error_shape(cb_server: str) -> None:
    client = openai.OpenAI(base_url=cb_server + "/v1", api_key="none")
    for kwargs in ({"prompt": [], "max_tokens": 2}, {"prompt": "hi", "max_tokens": 0},
                   {"prompt": "hi", "max_tokens": 2, "temperature": 0.7}, {"prompt": [10**9], "max_tokens": 2}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", **kwargs)


def test_the_hybrid_in_each_mode(tiny_qwen3_5, tmp_path: Path) -> None:
    """transformers' continuous batching has no cache for Gated DeltaNet layers: the server fails at
    start with transformers' own error; ``generate`` mode serves the same model."""
    model = tiny_qwen3_5(mtp_layers=0)
    proc, url = _start(model, "cb", tmp_path / "cb.log")
    try:
        ready = _wait(proc, url)
    finally:
        _stop(proc)
    log = (tmp_path / "cb.log").read_text()
    assert not ready and proc.returncode == 1, log[-2000:]
    assert "linear_attention" in log, log[-2000:]

    proc, url = _start(model, "generate", tmp_path / "generate.log")
    try:
        assert _wait(proc, url), (tmp_path / "generate.log").read_text()[-3000:]
        out = openai.OpenAI(base_url=url + "/v1", api_key="none").completions.create(
            model="m", prompt=[11, 12, 13], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage is not None and out.usage.completion_tokens == 4
    finally:
        _stop(proc)

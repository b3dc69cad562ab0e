"""``tokenline serve --data-parallel-size 2``: two real engine processes behind one API process.

Prefix affinity is observed the way a client sees it: a prompt sent twice in a row reports its
prefix as cached the second time only if both requests reached the same engine. Round robin sends
the pair to different engines (a control that shows the check can fail)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import Server, start_server, wait_until

PROMPTS = [f"Conversation {i}: " + " ".join(f"word{i}-{k}" for k in range(60)) for i in range(3)]


def _cached_pairs(server: Server) -> list[tuple[int, int]]:
    """Each prompt twice in a row; (prompt tokens, cached tokens of the second request) per prompt."""
    client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)
    pairs = []
    for prompt in PROMPTS:
        for attempt in range(2):
            completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2,
                                                   temperature=0)
        details = completion.usage.prompt_tokens_details
        pairs.append((completion.usage.prompt_tokens, details.cached_tokens if details else 0))
    return pairs


def _engine_pids(server: Server) -> list[int]:
    """The engine processes: children started by multiprocessing's spawn (not its resource tracker)."""
    pids = []
    for child in psutil.Process(server.process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("dp"), "--data-parallel-size", "2", "--threads-per-engine", "1",
                      "--routing-policy", "kv_events") as server:
        yield server


def test_two_engines_serve_and_a_repeated_prompt_finds_its_prefix(dp_server: Server) -> None:
    assert len(_engine_pids(dp_server)) == 2
    for prompt_tokens, cached in _cached_pairs(dp_server):
        assert cached >= prompt_tokens - 16  # all but the last partial block came from the cache
    metrics = dp_server.metrics()
    assert metrics["vllm:prefix_cache_hits_total"] > 0  # the fleet's counters are the engines' sum
    client = openai.OpenAI(base_url=dp_server.api_url, api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": "Say hello"}], n=2)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] and texts[1]


def test_a_dead_engine_is_restarted_and_the_other_keeps_serving(dp_server: Server) -> None:
    pids = _engine_pids(dp_server)
    os.kill(pids[0], signal.SIGKILL)
    client = openai.OpenAI(base_url=dp_server.api_url, api_key="none", max_retries=0)
    # Requests made right after the death go to the survivor (or fail before any byte and are retried).
    for i in range(4):
        completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Count {i}", max_tokens=2)
        assert completion.choices[0].text is not None
    assert wait_until(lambda: len(_engine_pids(dp_server)) == 2 and set(_engine_pids(dp_server)) != set(pids),
                      timeout=90)
    assert httpx.get(f"{dp_server.base_url}/health", timeout=5).status_code == 200


def test_round_robin_splits_a_repeated_prompt(tmp_path: Path) -> None:
    with start_server(tmp_path, "--data-parallel-size", "2", "--threads-per-engine", "1",
                      "--routing-policy", "round_robin") as server:
        pairs = _cached_pairs(server)
    assert all(cached == 0 for _, cached in pairs), pairs  # each pair's second request met a cold engine


def test_bad_data_parallel_flags_are_one_line_errors(tmp_path: Path) -> None:
    import subprocess
    import sys

    for flags, needle in ((["--data-parallel-size", "0"], "--data-parallel-size"),
                          (["--data-parallel-size", "2", "--routing-policy", "nope"], "nope"),
                          (["--threads-per-engine", "0"], "--threads-per-engine")):
        result = subprocess.run([sys.executable, "-m", "tokenline.cli", "serve", *flags], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and "Traceback" not in result.stderr

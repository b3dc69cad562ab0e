"""Prefix caching on a hybrid model through a real server: a four-turn chat over the official openai
client gets cached prompt tokens from its second turn on, its greedy (float32) replies equal an
offline engine's with caching off, and /metrics counts the hits and the state checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import TinyQwen3_5
from tests.e2e.conftest import Server, start_server
from tokenline import LLM, SamplingParams

SYSTEM = {"role": "system", "content": "You are a travel guide for Japan. Answer briefly, in plain words, one idea per line."}
QUESTIONS = ["Plan a day in Kyoto.", "And the evening?", "Where should I eat?", "How do I get back to Osaka?"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--served-model-name", "tiny", "--dtype", "float32", "--block-size", "16",
             "--hybrid-state-checkpoint-interval", "32", "--hybrid-state-checkpoints", "32")
    with start_server(tmp_path_factory.mktemp("hybrid-cache"), str(model_dir), *flags) as running:
        yield running


def offline_replies(model_dir: Path) -> list[str]:
    """The same chat on an offline engine with caching off (no checkpoints: no prefix caching)."""
    llm = LLM(model_dir, dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=2, hybrid_state_checkpoints=0)
    assert not llm.engine.kv_cache.enable_prefix_caching
    messages: list[dict[str, str]] = [SYSTEM]
    replies = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        text = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0].text
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def test_multi_turn_chat_hits_and_matches_an_uncached_engine(server: Server, model_dir: Path) -> None:
    client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)
    before = server.metrics()
    messages: list[dict[str, str]] = [SYSTEM]
    replies, cached = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS)
        text = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
        assert response.usage is not None and response.usage.prompt_tokens_details is not None
        cached.append(response.usage.prompt_tokens_details.cached_tokens or 0)
        assert response.usage.prompt_tokens < 512  # short prompts hit too
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached
    assert replies == offline_replies(model_dir)

    after = server.metrics()
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
    assert hits == sum(cached)
    assert after["tokenline_state_checkpoint_hits_total"] >= 3
    assert after["tokenline_state_checkpoints"] == 32
    assert 0 < after["tokenline_state_checkpoints_used"] <= 32


def test_a_bad_checkpoint_interval_is_a_one_line_error(model_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "tokenline.cli", "serve", str(model_dir), "--block-size", "16",
         "--hybrid-state-checkpoint-interval", "24"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "multiple of the block size" in result.stderr and "Traceback" not in result.stderr

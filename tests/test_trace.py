"""``tokenline trace``: one real request walked through the real engine, on the default model's real
weights and on the tiny hybrid model; the JSON facts checked against the tokenizer and each other,
and the rich rendering run into a string."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TinyQwen3_5
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.llm import LLM
from tokenline.store.model_store import resolve_model
from tokenline.trace_walk import Trace, load_prices, render, walk

QUESTION = "What is the capital of France?"
# float32: a prefix-cache hit computes the uncached tail on another path (one row, not the whole
# prompt), and bfloat16 rounds the two differently; this question's first token is a near tie (top
# two 0.08 nats apart in float32), so in bfloat16 a repeat could pick the other. float32 is exact.
DTYPE = "float32"


def run_trace(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "tokenline.cli", "trace", *args, "--json"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    prices = tmp_path_factory.mktemp("prices") / "prices.toml"
    prices.write_text('[default]\ninput = 1.0\noutput = 2.0\ncached_input = 0.5\n')
    return run_trace(QUESTION, "--max-tokens", "5", "--repeat", "2", "--prices", str(prices), "--dtype", DTYPE)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(dtype=DTYPE)


def test_template_tokens_and_blocks(traced: dict[str, Any]) -> None:
    prompt = traced["prompt"]
    assert "<|im_start|>" in prompt["text"] and "<|im_end|>" in prompt["text"]
    assert prompt["special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    assert QUESTION in prompt["text"]
    tokenizer = Tokenizer.from_dir(resolve_model(None))
    ids = [t["id"] for t in prompt["tokens"]]
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt["text"]
    assert [t["id"] for t in prompt["tokens"] if t["special"]] == [i for i in ids if i in tokenizer.all_special_ids]
    first = traced["runs"][0]
    kv = first["kv"]
    assert len(kv["prompt_blocks"]) == math.ceil(len(ids) / kv["block_size"])
    assert kv["cached_blocks"] == [] and kv["num_cached_tokens"] == 0
    assert kv["state_slot"] is None  # not a hybrid model


def test_a_repeat_hits_the_prefix_cache(traced: dict[str, Any]) -> None:
    first, second = traced["runs"]
    num_prompt = len(traced["prompt"]["tokens"])
    block_size = second["kv"]["block_size"]
    assert second["kv"]["num_cached_tokens"] == (num_prompt - 1) // block_size * block_size > 0
    # The hit blocks are the very blocks the first run filled.
    hit = second["kv"]["cached_blocks"]
    assert hit == first["kv"]["prompt_blocks"][: len(hit)]
    assert second["chunks"][0]["start_pos"] == second["kv"]["num_cached_tokens"]
    assert second["text"] == first["text"]  # greedy both times


def test_steps_candidates_times_and_receipt(traced: dict[str, Any]) -> None:
    num_prompt = len(traced["prompt"]["tokens"])
    for run in traced["runs"]:
        steps, receipt = run["steps"], run["receipt"]
        assert len(steps) == receipt["completion_tokens"] == 5
        for step in steps:
            best = max(c["logprob"] for c in step["candidates"])
            chosen = [c["logprob"] for c in step["candidates"] if c["token_id"] == step["token_id"]]
            assert chosen == [best]  # greedy: a top candidate is chosen (a tie may list another first)
            assert len(step["candidates"]) == 5
        assert "".join(s["emitted"] for s in steps) == run["text"]
        assert receipt["prompt_tokens"] == num_prompt
        assert receipt["cached_tokens"] == run["kv"]["num_cached_tokens"]
        prompt, cached, out = receipt["prompt_tokens"], receipt["cached_tokens"], receipt["completion_tokens"]
        assert receipt["cost_usd"] == pytest.approx(((prompt - cached) * 1.0 + cached * 0.5 + out * 2.0) / 1e6)
        times = run["times"]
        assert times["num_prefill_steps"] >= 1 and times["num_decode_steps"] == 4
        assert times["prefill_s"] > 0 and times["decode_s"] > 0 and times["queue_s"] >= 0
        prefill = [c for c in run["chunks"] if c["kind"] == "prefill"]
        assert prefill[-1]["start_pos"] + prefill[-1]["num_tokens"] == num_prompt
        assert run["finish_reason"] == "length"


def test_a_possible_stop_string_is_held_back(llm: LLM) -> None:
    plain = walk(llm, QUESTION, max_tokens=2)
    first = plain.runs[0].steps[0].text
    # A stop string that starts with the first token's text but never completes: that text waits.
    trace = walk(llm, QUESTION, max_tokens=2, stop=[first + "\u00a7\u00a7"])
    step = trace.runs[0].steps[0]
    assert step.held_stop_prefix == first and step.emitted == ""
    assert trace.runs[0].text == plain.runs[0].text  # released in the end
    # A stop string that does complete ends the text there, and the engine's tokens are billed.
    stopped = walk(llm, QUESTION, max_tokens=4, stop=[plain.runs[0].steps[1].text])
    run = stopped.runs[0]
    assert run.finish_reason == "stop" and run.text == first
    assert len(run.steps) == run.receipt.completion_tokens == 2


def test_the_rich_rendering_shows_every_stage(llm: LLM) -> None:
    from rich.console import Console

    trace: Trace = walk(llm, QUESTION, max_tokens=3, repeat=2, prices=load_prices(None))
    out = io.StringIO()
    render(trace, Console(file=out, width=120, force_terminal=False))
    text = out.getvalue()
    for title in ("rendered chat template", "prompt tokens", "KV cache", "time", "decode steps", "receipt"):
        assert title in text
    assert "<|im_start|>" in text and "from the prefix cache" in text and trace.runs[0].text[:3] in text


def test_the_hybrid_model_claims_a_state_slot(tiny_qwen3_5: TinyQwen3_5) -> None:
    trace = run_trace("Hello", "--model", str(tiny_qwen3_5()), "--max-tokens", "3", "--max-num-seqs", "2")
    run = trace["runs"][0]
    assert run["kv"]["state_slot"] in (0, 1)
    assert all(c["state_slot"] == run["kv"]["state_slot"] for c in run["chunks"])
    assert len(run["steps"]) == run["receipt"]["completion_tokens"]


def test_bad_input_is_a_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenline.cli", "trace", "Hi", "--top-candidates", "99", "--json"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2 and "--top-candidates" in result.stderr and "Traceback" not in result.stderr

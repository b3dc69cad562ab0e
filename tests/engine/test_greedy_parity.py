"""Greedy continuations of the real default model match HF transformers token for token,
however the engine batches, chunks, caches or preempts them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenline import LLM, SamplingParams
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.scheduler import SchedulerConfig

MAX_TOKENS = 24

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam"},
        {"role": "user", "content": "Another one, about mountains."},
    ],
    [{"role": "user", "content": "Translate 'good morning' into German and Spanish."}],
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(default_model_dir, dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    chats = [
        llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c), add_special_tokens=False) for c in CHATS
    ]
    return chats + [llm.tokenizer.encode(p) for p in RAW]


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=2,
            )
            expected.append(out[0, len(ids) :].tolist())
    return expected


def use_engine(
    llm: LLM, num_blocks: int, block_size: int = 16, budget: int = 2048, prefix: bool = True, fills_pool: bool = True
) -> None:
    """Give the LLM a fresh engine around the already loaded model (loading it again is slow)."""
    runner = llm.engine.runner
    runner.allocate_kv_cache(num_blocks, block_size)
    llm.engine = EngineCore(
        runner,
        KVCacheManager(num_blocks, block_size, prefix, cache_resident_blocks=None if fills_pool else 0),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=runner.max_model_len),
        eos_token_ids=runner.config.eos_token_ids,
        check_integrity_every_step=True,
    )


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def assert_pool_empty(llm: LLM) -> None:
    pool = llm.engine.kv_cache.pool
    llm.engine.scheduler.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_each_prompt_alone(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    use_engine(llm, num_blocks=64, prefix=False)
    assert [greedy(llm, [p])[0] for p in prompts] == reference
    assert_pool_empty(llm)


def test_all_prompts_in_one_batch(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    use_engine(llm, num_blocks=128, prefix=False)
    assert greedy(llm, prompts) == reference
    assert llm.engine.stats().num_preemptions == 0
    assert_pool_empty(llm)


def test_tiny_prefill_chunks(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    use_engine(llm, num_blocks=128, budget=7)
    assert greedy(llm, prompts) == reference
    assert_pool_empty(llm)


def test_tiny_kv_pool_forces_preemptions(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    use_engine(llm, num_blocks=40, block_size=4)
    assert greedy(llm, prompts) == reference
    assert llm.engine.stats().num_preemptions > 0
    assert_pool_empty(llm)


def test_prefix_cache_on_and_off_give_the_same_tokens(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # The pool keeps every freed prefix while it has untouched blocks (by default cached blocks are
    # evicted before new memory is touched, and the second pass would evict its own prefixes).
    use_engine(llm, num_blocks=256, block_size=4, prefix=True, fills_pool=True)
    assert greedy(llm, prompts) == reference
    # Second pass: every prompt's full blocks are cached now.
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Every full block of each prompt is reused, except that the last token is always recomputed.
    assert [o.num_cached_tokens for o in outputs] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_pool_empty(llm)


def test_prefill_spans_batched_through_attention(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]], batched_prefill_calls: list[int]
) -> None:
    # Every step's prefill spans in one attention call: new prompts side by side, chunks beside
    # other prompts' chunks, and spans after a cached prefix must give the same tokens. The torch
    # path's batching is what is under test: steps this small would otherwise take the one-call
    # decode layers (the tests above cover those).
    use_engine(llm, num_blocks=256, block_size=4, budget=64, prefix=True)
    model = llm.engine.runner.model
    fused_rows, model.fused_decode_rows = model.fused_decode_rows, 0
    try:
        assert greedy(llm, prompts) == reference
        assert greedy(llm, prompts) == reference  # now after cached prefixes
    finally:
        model.fused_decode_rows = fused_rows
    assert batched_prefill_calls and max(batched_prefill_calls) >= 3
    assert_pool_empty(llm)

"""The Qwen3.5 hybrid through the whole engine: greedy tokens match HF transformers alone, batched,
in tiny prefill chunks and under preemption; state slots always come back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.conftest import TinyQwen3_5
from tokenline import LLM, SamplingParams
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.scheduler import SchedulerConfig

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", max_num_seqs=8, num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    rng = random.Random(3)
    chat = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "Plan a trip to Kyoto."}]),
        add_special_tokens=False,
    )
    return [chat] + [[rng.randrange(0, 248000) for _ in range(n)] for n in (5, 23, 41)]


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=248044,
            )
            out.append(generated[0, len(ids):].tolist())
    return out


def use_engine(llm: LLM, num_blocks: int, budget: int = 2048, max_seqs: int = 8) -> None:
    runner = llm.engine.runner
    runner.allocate_kv_cache(num_blocks, 4, max_seqs)
    llm.engine = EngineCore(
        runner,
        KVCacheManager(num_blocks, 4, True, num_state_slots=max_seqs),
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096),
        eos_token_ids=runner.config.eos_token_ids,
        check_integrity_every_step=True,
    )


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_all_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    llm.engine.scheduler.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and kv.state_slots == {}


def test_alone_batched_chunked_and_preempted_match_hf(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    use_engine(llm, num_blocks=256)
    assert [greedy(llm, [p])[0] for p in prompts] == reference
    assert greedy(llm, prompts) == reference
    use_engine(llm, num_blocks=256, budget=7)  # prefill in chunks of at most 7 tokens, state carried
    assert greedy(llm, prompts) == reference
    use_engine(llm, num_blocks=26)  # every prompt fits at admission, not all outputs: preemptions
    assert greedy(llm, prompts) == reference
    assert llm.engine.stats().num_preemptions > 0
    assert_all_free(llm)


def test_state_slots_bound_concurrency_and_return_after_abort(llm: LLM, prompts: list[list[int]]) -> None:
    use_engine(llm, num_blocks=256, max_seqs=2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS, stop=["a", "e", "o"]),  # ends early: abort
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=2),
    ]
    llm.generate(prompts, params)
    assert_all_free(llm)


def test_padded_vocabulary_is_never_sampled(llm: LLM, prompts: list[list[int]]) -> None:
    use_engine(llm, num_blocks=256)
    assert llm.engine.runner.config.vocab_size == 248320 and llm.tokenizer.vocab_size == 248077
    params = SamplingParams(temperature=2.0, seed=5, max_tokens=40, ignore_eos=True, logprobs=5)
    for output in llm.generate(prompts, params):
        tokens = output.outputs[0].token_ids
        assert all(t < 248077 for t in tokens)
        assert all(i < 248077 for entry in output.outputs[0].logprobs for i, _ in entry.top)

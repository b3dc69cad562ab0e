"""Suffix speculative decoding through the real engine: float32 greedy outputs are token for token
those without it, batched (copies, random prompts, a story and sampled requests in one batch),
under preemption, with the prefix cache, and on the hybrid Qwen3.5 model; the counters see drafts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.engine import test_spec_decode_parity as parity
from tests.engine.test_hybrid_spec_decode import repetitive_prompts
from tokenline import LLM, SamplingParams
from tokenline.frontend.qwen_vocab import build_qwen_tokenizer
from tokenline.model.random_models import make_qwen3_5_tiny, scale_qwen3_5_linear_outputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
CODE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens, and wrote the weather in a leather logbook."
)


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(default_model_dir, dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """Two prompts the model copies from (drafts accepted), two random ones and a story (rejected)."""
    tokenizer = llm.tokenizer
    asks = [f"Repeat the following text exactly:\n\n{PASSAGE}",
            f"Rename the function area to rect_area and output the whole file:\n\n{CODE}"]
    out = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": a}]), add_special_tokens=False)
           for a in asks]
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(tokenizer.vocab_size) if i not in special]
    out += [[rng.choice(ordinary) for _ in range(24)] for _ in range(2)]
    out.append(tokenizer.encode("Once upon a time, in a small village at the edge of a great forest,"))
    return out


def use_engine(llm: LLM, speculative: bool, num_blocks: int = 128, block_size: int = 16, prefix: bool = False) -> None:
    parity.use_engine(llm, speculative, num_blocks, block_size, prefix, method="suffix")


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_pool_empty(llm: LLM) -> None:
    llm.engine.scheduler.check_integrity()
    pool = llm.engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.fixture(scope="module")
def expected(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    use_engine(llm, speculative=False)
    return generate(llm, prompts)


def test_batched_same_greedy_tokens_and_drafts_get_accepted(
    llm: LLM, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    use_engine(llm, speculative=True)
    assert generate(llm, prompts) == expected
    assert_pool_empty(llm)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Copying drafts long runs: well over one token per verified draft on average here.
    assert stats.spec_decode_num_accepted_tokens > 1.5 * stats.spec_decode_num_drafts


def test_sampled_and_logprob_requests_share_the_batch(llm: LLM, prompts: list[list[int]]) -> None:
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=32),
              SamplingParams(temperature=0.0, logprobs=2, max_tokens=32), GREEDY, GREEDY]
    use_engine(llm, speculative=False)
    plain = generate(llm, prompts, params)
    use_engine(llm, speculative=True)
    assert generate(llm, prompts, params) == plain
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_tiny_kv_pool_forces_preemptions(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    use_engine(llm, speculative=True, num_blocks=56, block_size=4)
    assert generate(llm, prompts) == expected
    assert_pool_empty(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_prefix_cache_on(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    use_engine(llm, speculative=True, num_blocks=256, block_size=4, prefix=True)
    assert generate(llm, prompts) == expected
    outputs = llm.generate(prompts, GREEDY)  # again: prompts (and accepted-draft blocks) from the cache
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.num_cached_tokens > 0 for o in outputs)
    assert_pool_empty(llm)


def test_hybrid_model_same_greedy_tokens(tmp_path: Path) -> None:
    """The runner keeps a hybrid model's recurrent state after the accepted drafts only; the suffix
    proposer's drafts (right and wrong) leave the outputs unchanged."""
    model = tmp_path / "qwen3_5"
    make_qwen3_5_tiny(model, seed=0)
    scale_qwen3_5_linear_outputs(model, 10.0)  # so that a state kept past a rejected draft shows
    build_qwen_tokenizer(model)
    prompts = repetitive_prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = generate(LLM(model, dtype="float32", max_num_seqs=8, num_kv_blocks=256, block_size=4), prompts, params)
    spec = LLM(model, dtype="float32", max_num_seqs=8, num_kv_blocks=256, block_size=4, speculative="suffix",
               check_integrity_every_step=True)
    assert generate(spec, prompts, params) == plain
    stats = spec.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0

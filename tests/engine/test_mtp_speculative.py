"""`--speculative mtp` on the tiny Qwen3.5 hybrid with random MTP weights: float32 greedy tokens are
the same with and without it (N = 1 and 3, batched, under preemption), the acceptance counters
agree with what was drafted, and a model without an MTP head is refused with a clear error.

Random MTP weights draft noise, so the target rejects nearly every draft; the oracle test makes
the head's drafts the target's own continuation (wholly, or up to a planted miss) so the
accepting branch runs too: accepted drafts, the hybrid state kept after them, the head's KV
caught up over several positions at once.

The text model's DeltaNet outputs are scaled up (``scale_qwen3_5_linear_outputs``): plain random
weights make the tiny hybrid repeat its last token whatever its state, which would hide a state that
kept rejected drafts; louder linear layers make every output token depend on it.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import TinyQwen3_5
from tokenline import LLM, SamplingParams
from tokenline.engine.config import EngineConfig
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.factory import build_engine_core
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.model.batch import SampledToken, ScheduledSeq, num_accepted_drafts
from tokenline.spec_decode.mtp_proposer import MtpProposer

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    return tiny_qwen3_5(linear_scale=40.0, mtp_layers=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(0, 248000) for _ in range(n)] for n in (5, 23, 41)]


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    """The same checkpoint without --speculative mtp (it loads: the head's weights are skipped)."""
    return LLM(model_dir, dtype="float32", max_num_seqs=4, num_kv_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts: list[list[int]]) -> list[list[int]]:
    out = greedy(plain, prompts)
    assert all(len(set(tokens)) > MAX_TOKENS // 2 for tokens in out)  # not one token repeated
    return out


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", max_num_seqs=4, num_kv_blocks=128, block_size=4,
               speculative="mtp", num_speculative_tokens=3, check_integrity_every_step=True)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def use_engine(llm: LLM, num_blocks: int, num_speculative_tokens: int, max_seqs: int = 4, budget: int = 2048) -> None:
    """A fresh engine (books, counters) over the same loaded runner, its pools re-allocated."""
    runner = llm.engine.runner
    assert runner.mtp is not None
    runner.mtp.num_speculative_tokens = num_speculative_tokens
    runner.allocate_kv_cache(num_blocks, 4, max_seqs)
    llm.engine = EngineCore(
        runner,
        KVCacheManager(num_blocks, 4, False, num_state_slots=max_seqs),
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096),
        eos_token_ids=runner.config.eos_token_ids,
        check_integrity_every_step=True,
        proposer=MtpProposer(num_speculative_tokens),
    )


def test_same_greedy_tokens_with_mtp_drafts(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    # N = 3 with prefix caching on (the fixture's engine), then N = 1; both batched.
    assert greedy(llm, prompts) == reference
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    assert 0 <= stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    use_engine(llm, num_blocks=128, num_speculative_tokens=1)
    assert greedy(llm, prompts) == reference
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens == stats.spec_decode_num_drafts > 0  # one draft per step


def test_sampled_and_logprob_requests_beside_drafting_ones(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    use_engine(llm, num_blocks=128, num_speculative_tokens=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True),  # the head skips it
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),  # never drafts
    ]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert outputs[0].token_ids == reference[0] and outputs[2].token_ids == reference[2]
    assert len(outputs[1].token_ids) == MAX_TOKENS and len(outputs[2].logprobs) == MAX_TOKENS
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_drafts <= MAX_TOKENS - 1  # the first request's steps only
    kv = llm.engine.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and kv.state_slots == {}


def test_same_tokens_in_prefill_chunks_and_under_preemption(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # Chunks of at most 9 tokens: the head's KV catches up over chunks that do not sample (the
    # token after each comes from the prompt), with drafts of decoding requests beside them.
    # The head drafts the same after its KV was built chunk by chunk as in one go.
    drafts = []
    for budget in (2048, 9):
        use_engine(llm, num_blocks=128, num_speculative_tokens=3, budget=budget)
        drafts.append(record_drafts(llm))
        try:
            assert greedy(llm, prompts) == reference
        finally:
            del llm.engine.runner.mtp.draft
        assert llm.engine.stats().spec_decode_num_drafts > 0
    common = drafts[0].keys() & drafts[1].keys()
    assert len(common) >= len(prompts) * (MAX_TOKENS - 3)
    assert all(drafts[0][key] == drafts[1][key] for key in common)
    use_engine(llm, num_blocks=24, num_speculative_tokens=3)  # every prompt fits, not all outputs
    assert greedy(llm, prompts) == reference
    assert llm.engine.stats().num_preemptions > 0
    kv = llm.engine.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and kv.state_slots == {}


def record_drafts(llm: LLM) -> dict[tuple[tuple[int, ...], int], list[int]]:
    """The head's drafts by (prompt, tokens they follow), as the engine runs (filled in place)."""
    drafter = llm.engine.runner.mtp
    assert drafter is not None
    real_draft = drafter.draft
    seen: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def draft(seqs: list[ScheduledSeq], hidden: torch.Tensor, sampled: dict[str, SampledToken]) -> None:
        real_draft(seqs, hidden, sampled)
        for seq in seqs:
            token = sampled.get(seq.request_id)
            if token is not None:
                known = seq.start_pos + seq.num_tokens - len(seq.draft_token_ids)
                length = known + num_accepted_drafts(seq.draft_token_ids, token) + 1
                seen[(tuple(seq.prompt_token_ids), length)] = list(token.next_draft_token_ids)

    drafter.draft = draft  # type: ignore[method-assign]
    return seen


def oracle(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]], miss_at: Callable[[int], int | None]
) -> list[tuple[int, int]]:
    """Make the MTP head's drafts the target's own continuation (the head still runs and its KV
    catches up as usual), with draft ``miss_at(n)`` (n: output tokens so far) made wrong. Returns,
    per step that verified drafts, (drafts accepted, drafts the plant says should be)."""
    drafter = llm.engine.runner.mtp
    assert drafter is not None
    real_draft = drafter.draft
    continuation = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
    verified: list[tuple[int, int]] = []
    planted: dict[str, int] = {}  # request id -> drafts that should be accepted

    def draft(seqs: list[ScheduledSeq], hidden: torch.Tensor, sampled: dict[str, SampledToken]) -> None:
        real_draft(seqs, hidden, sampled)
        for seq in seqs:
            token = sampled.get(seq.request_id)
            if token is None:
                continue
            accepted = num_accepted_drafts(seq.draft_token_ids, token)
            if seq.draft_token_ids:  # the scheduler may have cut the plant to fit max_tokens
                verified.append((accepted, min(planted.pop(seq.request_id), len(seq.draft_token_ids))))
            assert len(token.next_draft_token_ids) == drafter.num_speculative_tokens  # the head drafted
            known = seq.start_pos + seq.num_tokens - len(seq.draft_token_ids)
            num_out = known + accepted + 1 - len(seq.prompt_token_ids)
            drafts = continuation[tuple(seq.prompt_token_ids)][num_out : num_out + drafter.num_speculative_tokens]
            miss = miss_at(num_out)
            if miss is not None and miss < len(drafts):
                drafts[miss] = (drafts[miss] + 1) % 1000
            token.next_draft_token_ids = drafts
            planted[seq.request_id] = len(drafts) if miss is None else min(miss, len(drafts))

    drafter.draft = draft  # type: ignore[method-assign]
    return verified


def test_drafts_the_target_agrees_with_are_accepted(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    use_engine(llm, num_blocks=128, num_speculative_tokens=3)
    verified = oracle(llm, prompts, reference, lambda n: None)
    try:
        assert greedy(llm, prompts) == reference
    finally:
        del llm.engine.runner.mtp.draft  # back to the class's method
    stats = llm.engine.stats()
    assert [a for a, _ in verified] == [b for _, b in verified]
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens == sum(a for a, _ in verified) > 0
    assert stats.spec_decode_num_drafts == len(verified)
    # One prefill step, then 1 + 3 tokens a step for the 11 tokens left: 4 steps (12 without drafts).
    assert stats.num_steps == 4

    # A planted miss at a varying draft: accepted up to it, the hybrid state and the head's KV kept
    # after the accepted tokens only, and the tokens still the target's own.
    use_engine(llm, num_blocks=128, num_speculative_tokens=3)
    verified = oracle(llm, prompts, reference, lambda n: n % 4 if n % 4 < 3 else None)
    try:
        assert greedy(llm, prompts) == reference
    finally:
        del llm.engine.runner.mtp.draft
    stats = llm.engine.stats()
    assert [a for a, _ in verified] == [b for _, b in verified]
    assert stats.spec_decode_num_accepted_tokens == sum(a for a, _ in verified)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_model_without_an_mtp_head_is_refused(tmp_path: Path, plain: LLM, tiny_qwen3_5: TinyQwen3_5) -> None:
    config = EngineConfig(dtype="float32", num_kv_blocks=16, speculative="mtp")
    no_head = tiny_qwen3_5(mtp_layers=0)
    with pytest.raises(ValueError, match="states no MTP head"):
        build_engine_core(config, no_head)
    stripped = tmp_path / "stripped"  # config names the head, weights stripped (as some quantized copies)
    shutil.copytree(no_head, stripped)
    raw = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="no mtp.\\* weights"):
        build_engine_core(config, stripped)
    # Without --speculative mtp the same checkpoint loads (the head's weights are skipped).
    assert plain.engine.runner.mtp is None


def test_a_dense_model_is_refused(tmp_path: Path) -> None:
    from tokenline.model.random_models import make_qwen3_tiny

    make_qwen3_tiny(tmp_path)
    with pytest.raises(ValueError, match="needs a hybrid Qwen3.5-class model with an MTP head"):
        build_engine_core(EngineConfig(dtype="float32", num_kv_blocks=16, speculative="mtp"), tmp_path)


def test_the_head_kv_counts_in_the_block_size(plain: LLM, llm: LLM) -> None:
    # The tiny model has one full-attention layer; the MTP layer adds as much again per block.
    assert llm.engine.runner.kv_bytes_per_block(4) == 2 * plain.engine.runner.kv_bytes_per_block(4)

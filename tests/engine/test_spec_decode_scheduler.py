"""Speculative decoding's bookkeeping with a fake runner: which requests draft, what is accepted,
how computed tokens, blocks, the prefix cache and stop conditions follow."""

from __future__ import annotations

import pytest

from tests.engine.fake_runner import FakeRunner
from tests.engine.test_scheduler import assert_all_blocks_free, tokens
from tokenline.cli import build_parser, engine_config_from_args
from tokenline.engine.block_pool import hash_block
from tokenline.engine.config import EngineConfig
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineOutput, EngineRequest, FinishReason
from tokenline.engine.scheduler import DRAFTS_WITHIN_FUSED_MIN_DECODES, SchedulerConfig
from tokenline.sampling_params import SamplingParams
from tokenline.spec_decode.ngram_proposer import NgramProposer

EOS = 0
# A prompt whose tail [5, 6] occurred before, followed by 7, 8, 9, 10: the proposer drafts those.
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6]


def make_engine(
    speculative: bool = True,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_model_len: int = 256,
    prefix_caching: bool = True,
    script: dict[str, list[int]] | None = None,
    k: int = 4,
    num_state_slots: int = 0,
    fused_step_tokens: int = 0,
) -> EngineCore:
    return EngineCore(
        FakeRunner(script=script),
        KVCacheManager(num_blocks, block_size, prefix_caching, num_state_slots),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        fused_step_tokens=fused_step_tokens),
        eos_token_ids=[EOS],
        check_integrity_every_step=True,
        proposer=NgramProposer(k, 2, 4) if speculative else None,
    )


def add(engine: EngineCore, request_id: str, prompt: list[int], **params: object) -> None:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(**params)))


def run(engine: EngineCore, max_steps: int = 500) -> dict[str, list[EngineOutput]]:
    """Step to the end, checking after every step that the prefix cache only indexes blocks whose
    tokens are all computed and accepted, under the hash of exactly those tokens."""
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        assert_cache_index_is_accepted_tokens(engine)
    assert not engine.has_unfinished_requests()
    return outputs


def assert_cache_index_is_accepted_tokens(engine: EngineCore) -> None:
    kv = engine.kv_cache
    size = kv.block_size
    for request in engine.scheduler.running:
        table = kv.tables[request.request_id]
        num_indexed = kv._num_indexed.get(request.request_id, 0)
        assert num_indexed <= request.num_computed_tokens // size
        assert request.num_computed_tokens <= request.num_tokens
        parent = None
        for index in range(num_indexed):
            parent = hash_block(parent, request.token_ids[index * size : (index + 1) * size])
            assert kv.pool.block_hash[table[index]] in (None, parent)
        # No block beyond the computed tokens carries a hash.
        for block_id in table[request.num_computed_tokens // size + 1 :]:
            assert kv.pool.block_hash[block_id] is None


def drafted(engine: EngineCore, request_id: str) -> list[list[int]]:
    """The drafts each step sent to the runner for the request."""
    return [list(s.draft_token_ids) for b in engine.runner.batches for s in b.seqs if s.request_id == request_id]


def test_all_drafts_accepted_plus_the_models_own_token() -> None:
    engine = make_engine(script={"a": [7, 8, 9, 10, 11, 12, 13, 14]})
    add(engine, "a", PROMPT, max_tokens=8)
    engine.step()  # prefill: samples 7
    out = engine.step()
    # Drafted [8, 9, 10, 11] after [..., 6, 7]; all four agree with the model, which then adds 12.
    assert drafted(engine, "a")[-1] == [8, 9, 10, 11]
    assert out[0].new_token_ids == [8, 9, 10, 11, 12]
    request = engine.scheduler.requests["a"]
    assert request.num_computed_tokens == request.num_tokens - 1
    stats = engine.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 4)
    assert stats.spec_decode_num_accepted_tokens == 4
    rest = run(engine)["a"]
    assert [7, *out[0].new_token_ids, *tokens(rest)] == [7, 8, 9, 10, 11, 12, 13, 14]
    assert rest[-1].finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(engine)


def test_rejected_draft_keeps_the_accepted_prefix_and_the_models_token() -> None:
    engine = make_engine(script={"a": [7, 8, 9, 42, 43, 44]})
    add(engine, "a", PROMPT, max_tokens=6)
    engine.step()
    before = engine.scheduler.requests["a"].num_computed_tokens
    out = engine.step()
    assert drafted(engine, "a")[-1] == [8, 9, 10, 11]
    # 8 and 9 agree, 10 does not: the model's 42 replaces it and 11 is dropped.
    assert out[0].new_token_ids == [8, 9, 42]
    request = engine.scheduler.requests["a"]
    assert request.num_computed_tokens == before + 3  # the last token and two accepted drafts
    assert engine.stats().spec_decode_num_accepted_tokens == 2
    run(engine)
    assert_all_blocks_free(engine)


def test_first_draft_rejected_still_gives_one_token() -> None:
    engine = make_engine(script={"a": [7, 99, 98, 97, 96, 95]})
    add(engine, "a", PROMPT, max_tokens=6)
    engine.step()
    out = engine.step()
    assert drafted(engine, "a")[-1] == [8, 9, 10, 11] and out[0].new_token_ids == [99]
    assert engine.stats().spec_decode_num_accepted_tokens == 0
    run(engine)
    assert_all_blocks_free(engine)


def test_stops_inside_an_accepted_run_drop_the_rest() -> None:
    script = [7, 8, EOS, 10, 11]
    engine = make_engine(script={"eos": script, "stop": [7, 8, 9, 10, 11], "ign": script})
    add(engine, "eos", PROMPT, max_tokens=8)
    add(engine, "stop", PROMPT, max_tokens=8, stop_token_ids=[9])
    add(engine, "ign", PROMPT, max_tokens=6, ignore_eos=True)
    out = run(engine)
    assert tokens(out["eos"]) == [7, 8, EOS] and out["eos"][-1].finish_reason == FinishReason.STOP
    assert out["eos"][-1].num_output_tokens == 3
    assert tokens(out["stop"]) == [7, 8, 9] and out["stop"][-1].stop_reason == 9
    # ignore_eos: EOS is an ordinary token there, so the run goes on to max_tokens.
    assert tokens(out["ign"])[:3] == [7, 8, EOS] and len(tokens(out["ign"])) == 6
    assert_all_blocks_free(engine)


def test_drafts_never_run_past_max_tokens_or_max_model_len() -> None:
    engine = make_engine(script={"a": [7, 8, 9, 10, 11, 12], "b": [7, 8, 9, 10, 11, 12]}, max_model_len=13)
    add(engine, "a", PROMPT, max_tokens=3)
    add(engine, "b", PROMPT, max_tokens=None)
    out = run(engine)
    # a: one token from the prefill, then room for one draft and the model's token.
    assert drafted(engine, "a") == [[], [8]]
    assert tokens(out["a"]) == [7, 8, 9] and out["a"][-1].finish_reason == FinishReason.LENGTH
    # b: the context ends at 13 tokens (9 prompt + 4), whatever the drafts.
    assert tokens(out["b"]) == [7, 8, 9, 10] and out["b"][-1].finish_reason == FinishReason.LENGTH
    assert max(len(d) for d in drafted(engine, "b")) <= 2
    assert_all_blocks_free(engine)


def test_drafts_count_in_the_token_budget() -> None:
    engine = make_engine(budget=12)
    add(engine, "a", PROMPT, max_tokens=20)
    add(engine, "b", PROMPT, max_tokens=20)
    run(engine)
    assert all(b.num_tokens <= 12 for b in engine.runner.batches)
    assert_all_blocks_free(engine)


def decode_steps(num_seqs: int, fused_step_tokens: int) -> list[int]:
    """Tokens of each step in which every sequence decodes, for ``num_seqs`` drafting requests."""
    engine = make_engine(budget=256, num_blocks=256, fused_step_tokens=fused_step_tokens)
    for i in range(num_seqs):
        add(engine, f"r{i}", PROMPT, max_tokens=20)
    run(engine)
    assert_all_blocks_free(engine)
    return [b.num_tokens for b in engine.runner.batches
            if len(b.seqs) == num_seqs and all(s.num_tokens == 1 + len(s.draft_token_ids) for s in b.seqs)]


def test_drafts_keep_a_large_batch_on_the_one_call_layers() -> None:
    # From DRAFTS_WITHIN_FUSED_MIN_DECODES decoding sequences, drafts fill only the rows left below
    # the model's one-call decode layer cap; they still draft up to it.
    many = DRAFTS_WITHIN_FUSED_MIN_DECODES + 2
    capped = decode_steps(many, fused_step_tokens=many + 3)
    assert capped and max(capped) == many + 3
    assert max(decode_steps(many, fused_step_tokens=0)) > many + 3  # no such layers: the budget's
    # A small batch drafts past the cap (its steps read more than they compute: drafts pay there).
    few = DRAFTS_WITHIN_FUSED_MIN_DECODES - 1
    assert max(decode_steps(few, fused_step_tokens=few + 1)) > few + 1


def test_only_plain_greedy_requests_draft() -> None:
    engine = make_engine()
    add(engine, "greedy", PROMPT)
    add(engine, "unset", PROMPT, temperature=None)  # not resolved: the engine cannot know it is greedy
    add(engine, "random", PROMPT, temperature=0.8, seed=1)
    add(engine, "logprobs", PROMPT, logprobs=2)
    add(engine, "presence", PROMPT, presence_penalty=0.5)
    add(engine, "frequency", PROMPT, frequency_penalty=0.5)
    add(engine, "repetition", PROMPT, repetition_penalty=1.2)
    add(engine, "bias", PROMPT, logit_bias={3: 1.0})
    add(engine, "min", PROMPT, min_tokens=3)
    run(engine)
    assert any(drafted(engine, "greedy"))
    for rid in ("unset", "random", "logprobs", "presence", "frequency", "repetition", "bias"):
        assert not any(drafted(engine, rid)), rid
    # min_tokens: no drafts while EOS is banned, drafts after.
    min_drafts = drafted(engine, "min")
    assert not any(min_drafts[:3]) and any(min_drafts[3:])
    assert_all_blocks_free(engine)


def test_hybrid_models_speculate_and_state_checkpoints_never_hold_drafts() -> None:
    """A hybrid model's sequences draft like any other (the runner rolls the recurrent state back
    to the accepted tokens); a state checkpoint is planned only up to the last known token, never
    at a draft's position, even when a block boundary falls among the drafts."""
    engine = EngineCore(
        FakeRunner(script={"a": [7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}),  # accepts 7, 8, rejects 9, 10
        KVCacheManager(64, 4, True, num_state_slots=4, num_checkpoints=8, checkpoint_interval=4),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
        eos_token_ids=[EOS],
        check_integrity_every_step=True,
        proposer=NgramProposer(4, 2, 4),
    )
    add(engine, "a", PROMPT, max_tokens=12)
    add(engine, "b", PROMPT, max_tokens=12)  # unscripted: accepts every draft
    run(engine)
    assert engine.scheduler.proposer is not None and any(drafted(engine, "a")) and any(drafted(engine, "b"))
    stats = engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for batch in engine.runner.batches:
        for seq in batch.seqs:
            known = seq.num_tokens - len(seq.draft_token_ids)
            assert all(offset <= known for offset, _ in seq.state_checkpoints), seq
    saved = engine.kv_cache.checkpoints.stats.saved
    assert saved > 0
    assert_all_blocks_free(engine)


def test_same_tokens_with_and_without_speculation_under_preemption() -> None:
    """The fake model's +1 rule against drafts from repeated runs: partly accepted, partly not.
    A tiny pool preempts requests; outputs must not change and no block may leak."""
    prompts = {f"r{i}": [10 + i, 11 + i, 12 + i, 13 + i, 10 + i, 11 + i] * (1 + i % 3) for i in range(6)}
    results = {}
    for speculative in (False, True):
        engine = make_engine(speculative=speculative, num_blocks=14, block_size=4, budget=16)
        for rid, prompt in prompts.items():
            add(engine, rid, prompt, max_tokens=12)
        out = run(engine)
        results[speculative] = {rid: tokens(o) for rid, o in out.items()}
        assert_all_blocks_free(engine)
        if speculative:
            stats = engine.stats()
            assert stats.num_preemptions > 0
            assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert results[True] == results[False]


def test_speculation_only_takes_free_blocks() -> None:
    # a holds 3 blocks, b the 4th: in step 2, a's drafts would need a 5th block. Rather than
    # preempting b, a decodes one token; once b has finished, a drafts again.
    engine = make_engine(num_blocks=4, block_size=4, script={"a": [7, 8, 9, 10, 11, 12]})
    add(engine, "a", PROMPT, max_tokens=6)
    add(engine, "b", [1, 2, 3], max_tokens=2)
    out = run(engine)
    assert drafted(engine, "a")[:3] == [[], [], [9, 10, 11]]
    assert tokens(out["a"]) == [7, 8, 9, 10, 11, 12] and tokens(out["b"]) == [4, 5]
    assert engine.stats().num_preemptions == 0
    assert_all_blocks_free(engine)


def test_prefix_cache_reuses_blocks_written_by_accepted_drafts() -> None:
    script = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    engine = make_engine(block_size=4, script={"a": script, "b": script[8:]})
    add(engine, "a", PROMPT, max_tokens=10)
    first = tokens(run(engine)["a"])
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    # b's prompt is a's prompt + output: the blocks a computed (mostly through drafts) are reused.
    add(engine, "b", PROMPT + first[:8], max_tokens=2)
    out = run(engine)["b"]
    assert out[-1].num_cached_tokens == (len(PROMPT) + 8 - 1) // 4 * 4
    assert tokens(out) == [15, 16]
    assert_all_blocks_free(engine)


def test_engine_config_and_flags() -> None:
    for bad in ({"speculative": "eagle"}, {"num_speculative_tokens": 0},
                {"prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"prompt_lookup_min": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**bad).validate()
    for command in (["serve"], ["generate", "hi"], ["bench", "throughput"]):
        args = build_parser().parse_args([*command, "--speculative", "ngram", "--num-speculative-tokens", "3",
                                          "--prompt-lookup-max", "5", "--prompt-lookup-min", "1"])
        config = engine_config_from_args(args)
        assert (config.speculative, config.num_speculative_tokens) == ("ngram", 3)
        assert (config.prompt_lookup_max, config.prompt_lookup_min) == (5, 1)
    assert engine_config_from_args(build_parser().parse_args(["serve"])).speculative is None

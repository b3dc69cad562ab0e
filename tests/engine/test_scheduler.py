"""Scheduler and engine loop on CPU with a fake runner: batching, chunking, preemption, abort."""

from __future__ import annotations

import pytest

from tests.engine.fake_runner import FakeRunner
from tokenline.engine.engine_core import EngineCore, RequestRejected
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineOutput, EngineRequest, FinishReason
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.sampling_params import SamplingParams

EOS = 0


def make_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 16,
    max_model_len: int = 256,
    prefix_caching: bool = True,
    script: dict[str, list[int]] | None = None,
) -> EngineCore:
    return EngineCore(
        FakeRunner(script=script),
        KVCacheManager(num_blocks, block_size, prefix_caching),
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len),
        eos_token_ids=[EOS],
        check_integrity_every_step=True,
    )


def add(engine: EngineCore, request_id: str, prompt: list[int], **params: object) -> None:
    params.setdefault("max_tokens", 4)
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(**params)))


def run(engine: EngineCore, max_steps: int = 500) -> dict[str, list[EngineOutput]]:
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished_requests()
    return outputs


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def assert_all_blocks_free(engine: EngineCore) -> None:
    engine.scheduler.check_integrity()
    pool = engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_generates_until_max_tokens_and_frees_blocks() -> None:
    engine = make_engine()
    add(engine, "a", [10, 11, 12], max_tokens=5)
    outputs = run(engine)["a"]
    assert tokens(outputs) == [13, 14, 15, 16, 17]
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert outputs[-1].num_output_tokens == 5 and outputs[-1].num_prompt_tokens == 3
    assert_all_blocks_free(engine)


def test_eos_stop_token_ids_min_tokens_and_ignore_eos() -> None:
    engine = make_engine(script={"eos": [5, EOS, 7], "stopid": [5, 42, 7], "min": [EOS, EOS, 9], "ign": [EOS, 3]})
    add(engine, "eos", [1], max_tokens=10)
    add(engine, "stopid", [1], max_tokens=10, stop_token_ids=[42])
    add(engine, "min", [1], max_tokens=10, min_tokens=2)
    add(engine, "ign", [1], max_tokens=2, ignore_eos=True)
    out = run(engine)
    assert tokens(out["eos"]) == [5, EOS] and out["eos"][-1].finish_reason == FinishReason.STOP
    assert tokens(out["stopid"]) == [5, 42] and out["stopid"][-1].stop_reason == 42
    # EOS is banned until min_tokens are out: the fake runner then picks EOS+1.
    assert tokens(out["min"])[:2] == [1, 1]
    assert tokens(out["ign"]) == [EOS, 3] and out["ign"][-1].finish_reason == FinishReason.LENGTH


def test_chunked_prefill_runs_beside_decodes_within_the_budget() -> None:
    engine = make_engine(budget=8)
    add(engine, "short", [1, 2], max_tokens=6)
    engine.step()  # short's prefill
    add(engine, "long", list(range(100, 130)), max_tokens=2)
    batches = engine.runner.batches
    run(engine)
    later = batches[1:]
    # Every step respects the budget, and while "long" prefills, "short" keeps decoding in the same step.
    assert all(b.num_tokens <= 8 for b in batches)
    mixed = [b for b in later if {s.request_id for s in b.seqs} == {"short", "long"}]
    assert mixed and all(next(s for s in b.seqs if s.request_id == "short").num_tokens == 1 for b in mixed)
    long_chunks = [s.num_tokens for b in later for s in b.seqs if s.request_id == "long" and not s.sample]
    assert len(long_chunks) >= 3  # 30 prompt tokens through a budget of 8
    assert_all_blocks_free(engine)


def test_max_num_seqs_caps_the_running_batch() -> None:
    engine = make_engine(max_seqs=2)
    for i in range(5):
        add(engine, f"r{i}", [i + 1], max_tokens=3)
    run(engine)
    assert max(len(b.seqs) for b in engine.runner.batches) == 2
    assert_all_blocks_free(engine)


def test_requests_wait_until_their_blocks_fit() -> None:
    engine = make_engine(num_blocks=4, block_size=4, prefix_caching=False)
    add(engine, "a", list(range(1, 10)), max_tokens=3)  # 9 + 3 tokens: 3 blocks
    add(engine, "b", list(range(20, 29)), max_tokens=3)
    engine.step()
    assert engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 1
    out = run(engine)
    assert set(out) == {"a", "b"}
    assert_all_blocks_free(engine)


def test_preemption_when_blocks_run_out_then_recompute() -> None:
    reference = run_requests(make_engine(num_blocks=64, block_size=2))
    engine = make_engine(num_blocks=12, block_size=2)
    outputs = run_requests(engine)
    assert engine.scheduler.num_preemptions > 0
    assert outputs == reference  # preempted requests recompute and produce the same tokens
    assert_all_blocks_free(engine)


def run_requests(engine: EngineCore) -> dict[str, list[int]]:
    for i in range(4):
        add(engine, f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=8)
    return {rid: tokens(outs) for rid, outs in run(engine).items()}


def test_preempts_the_latest_lowest_priority_request() -> None:
    engine = make_engine(num_blocks=6, block_size=2)
    engine.add_request(EngineRequest("vip", [1, 2, 3], SamplingParams(max_tokens=6), priority=-1))
    engine.add_request(EngineRequest("old", [4, 5, 6], SamplingParams(max_tokens=6), arrival_time=0.0))
    engine.add_request(EngineRequest("new", [7, 8, 9], SamplingParams(max_tokens=6), arrival_time=1.0))
    requests = dict(engine.scheduler.requests)
    engine.step()
    assert engine.scheduler.num_running == 3
    run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert requests["vip"].num_preemptions == 0
    assert requests["new"].num_preemptions > 0
    assert requests["new"].num_preemptions >= requests["old"].num_preemptions
    assert_all_blocks_free(engine)


def test_abort_from_queue_and_batch_frees_everything() -> None:
    engine = make_engine(num_blocks=8, block_size=4, max_seqs=1)
    add(engine, "running", [1, 2, 3, 4, 5], max_tokens=20)
    add(engine, "queued", [6, 7, 8], max_tokens=20)
    engine.step()
    engine.step()
    assert engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 1
    aborted = engine.abort_request("running")
    assert aborted is not None and aborted.finish_reason == FinishReason.ABORT
    assert aborted.num_output_tokens == 2  # the tokens actually produced, for billing
    assert engine.abort_request("queued").num_output_tokens == 0
    assert engine.abort_request("nope") is None
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_all_blocks_free(engine)


def test_prefix_cache_hits_are_reported_and_outputs_unchanged() -> None:
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks of 4
    cold = make_engine(prefix_caching=False)
    add(cold, "x", prompt, max_tokens=5)
    expected = tokens(run(cold)["x"])

    engine = make_engine()
    add(engine, "first", prompt, max_tokens=5)
    first = run(engine)["first"]
    add(engine, "second", prompt, max_tokens=5)
    second = run(engine)["second"]
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 16
    assert tokens(first) == tokens(second) == expected
    stats = engine.stats()
    assert stats.prefix_cache_queries == 34 and stats.prefix_cache_hits == 16
    assert_all_blocks_free(engine)


def test_last_prompt_token_is_always_recomputed() -> None:
    engine = make_engine()
    prompt = list(range(1, 17))  # exactly 4 full blocks
    add(engine, "a", prompt, max_tokens=2)
    run(engine)
    add(engine, "b", prompt, max_tokens=2)
    engine.step()
    (seq,) = engine.runner.batches[-1].seqs
    assert seq.start_pos == 12 and list(seq.token_ids) == prompt[12:] and seq.sample
    run(engine)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "param"),
    [(0, 4, "prompt"), (256, 4, "prompt"), (250, 10, "max_tokens")],
)
def test_requests_that_can_never_fit_are_rejected_up_front(prompt_len: int, max_tokens: int, param: str) -> None:
    engine = make_engine(max_model_len=256, num_blocks=128)
    with pytest.raises(RequestRejected) as info:
        add(engine, "x", list(range(1, prompt_len + 1)), max_tokens=max_tokens)
    assert info.value.param == param
    assert not engine.has_unfinished_requests()


def test_request_larger_than_the_whole_pool_is_rejected() -> None:
    engine = make_engine(num_blocks=2, block_size=4)
    with pytest.raises(RequestRejected, match="KV cache"):
        add(engine, "x", [1, 2, 3, 4, 5, 6], max_tokens=4)


def test_duplicate_request_id_is_refused() -> None:
    engine = make_engine()
    add(engine, "x", [1])
    with pytest.raises(ValueError):
        add(engine, "x", [1])


def make_hybrid_engine(num_state_slots: int, num_blocks: int = 64, block_size: int = 4) -> EngineCore:
    return EngineCore(
        FakeRunner(),
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, num_state_slots=num_state_slots),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256),
        eos_token_ids=[EOS],
        check_integrity_every_step=True,
    )


def test_hybrid_state_slots_bound_the_batch_and_are_returned() -> None:
    engine = make_hybrid_engine(num_state_slots=2)
    for i in range(5):
        add(engine, f"r{i}", [i + 1, i + 2, i + 3], max_tokens=4)
    run(engine)
    batches = engine.runner.batches
    assert max(len(b.seqs) for b in batches) == 2  # admission waits for a free slot
    for batch in batches:
        slots = [s.state_slot for s in batch.seqs]
        assert None not in slots and len(set(slots)) == len(slots)
    kv = engine.kv_cache
    assert kv.state_slots == {} and sorted(kv._free_slots) == [0, 1]
    assert not kv.enable_prefix_caching  # a KV prefix alone cannot restore a recurrent state
    assert_all_blocks_free(engine)


def test_hybrid_preemption_and_abort_free_the_slot() -> None:
    engine = make_hybrid_engine(num_state_slots=3, num_blocks=8, block_size=2)
    for i in range(3):
        add(engine, f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=8)
    engine.step()
    engine.step()
    assert engine.abort_request("r2") is not None
    run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.state_slots == {}
    assert_all_blocks_free(engine)

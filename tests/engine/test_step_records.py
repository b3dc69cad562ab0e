"""Per-step records and the injectable clock: the real scheduler and engine loop on simulated time
(fake runner, no model)."""

from __future__ import annotations

import ast
import inspect

from tests.engine.fake_runner import FakeRunner
from tokenline.engine import engine_core, request, scheduler
from tokenline.engine.engine_core import MAX_STEP_RECORDS, EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest, StepRecord
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.model.batch import SampledToken, ScheduledBatch
from tokenline.sampling_params import SamplingParams


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class TimedRunner(FakeRunner):
    """A fake runner whose steps take simulated time: 1 ms plus 0.1 ms per token computed."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        self.clock.now += 0.001 + 0.0001 * sum(len(s.token_ids) for s in batch.seqs)
        return super().execute(batch)


def make_engine(clock: FakeClock | None = None, num_blocks: int = 64, block_size: int = 4, budget: int = 8,
                num_state_slots: int = 0) -> EngineCore:
    kwargs = {} if clock is None else {"clock": clock}
    return EngineCore(
        TimedRunner(clock) if clock is not None else FakeRunner(),
        KVCacheManager(num_blocks, block_size, True, num_state_slots),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256),
        eos_token_ids=[0],
        check_integrity_every_step=True,
        **kwargs,
    )


def add(engine: EngineCore, request_id: str, prompt: list[int], max_tokens: int, arrival: float | None = None) -> None:
    timing = {} if arrival is None else {"arrival_time": arrival}
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens), **timing))


def run(engine: EngineCore) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.timings
    return finished


def test_prefill_and_decode_tokens_match_what_was_scheduled() -> None:
    engine = make_engine(budget=8)
    add(engine, "long", list(range(1, 20)), max_tokens=3)  # 19 prompt tokens: chunks of 8, 8, 3
    add(engine, "short", [5, 6, 7], max_tokens=4)
    run(engine)
    records = engine.take_step_records()
    batches = engine.runner.batches
    assert len(records) == len(batches) and [r.step for r in records] == list(range(len(batches)))
    for record, batch in zip(records, batches):
        assert record.num_seqs == len(batch.seqs)
        assert record.num_tokens == sum(len(s.token_ids) for s in batch.seqs)
    # Step 0: 8 prompt tokens of "long"; step 1: 8 more; step 2: the last 3 of "long" + 3 of "short";
    # then each running request decodes one token per step.
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in records[:3]] == [(8, 0), (8, 0), (6, 0)]
    assert records[3].num_prefill_tokens == 0 and records[3].num_decode_tokens == 2
    assert sum(r.num_decode_tokens for r in records) == (3 - 1) + (4 - 1)  # first tokens come from prefill
    assert sum(r.num_prefill_tokens for r in records) == 19 + 3
    last = records[-1]
    assert last.num_running == 0 and last.num_waiting == 0 and last.num_kv_blocks_used == 0
    assert last.num_kv_blocks == 64 and records[0].num_kv_blocks_used == 2 and records[0].num_waiting == 1
    assert engine.take_step_records() == []  # drained


def test_recomputation_after_preemption_counts_as_prefill_and_preemptions_are_recorded() -> None:
    engine = make_engine(num_blocks=12, block_size=2, budget=64)
    for i in range(4):
        add(engine, f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=8)
    run(engine)
    records = engine.take_step_records()
    assert sum(r.num_preemptions for r in records) == engine.scheduler.num_preemptions > 0
    assert sum(r.num_tokens for r in records) == sum(len(s.token_ids) for b in engine.runner.batches for s in b.seqs)
    assert sum(r.num_prefill_tokens for r in records) > 4 * 3  # the recomputed sequences
    # Without preemption each request would decode 7 tokens (its first comes with its prefill); each
    # recomputation samples one of them at the end of a prefill instead.
    decode = sum(r.num_decode_tokens for r in records)
    assert 4 * 7 - engine.scheduler.num_preemptions <= decode < 4 * 7


def test_hybrid_records_count_state_slots() -> None:
    engine = make_engine(num_state_slots=2)
    for i in range(3):
        add(engine, f"r{i}", [i + 1, i + 2, i + 3], max_tokens=3)
    engine.step()
    (record,) = engine.take_step_records()
    assert record.num_state_slots == 2 and record.num_state_slots_used == 2 and record.num_waiting == 1


def test_the_scheduler_runs_on_a_fake_clock() -> None:
    clock = FakeClock(1000.0)
    engine = make_engine(clock, budget=8)
    add(engine, "a", list(range(1, 12)), max_tokens=3, arrival=999.0)  # 11 prompt tokens: 8 + 3
    clock.now = 1000.5
    timings = run(engine)["a"]
    records = engine.take_step_records()
    # Step times: 1 ms + 0.1 ms per token: 1.8 ms, 1.3 ms, then two decodes of 1.1 ms.
    durations = [0.0018, 0.0013, 0.0011, 0.0011]
    assert [round(r.duration, 7) for r in records] == durations
    starts = [1000.5 + sum(durations[:i]) for i in range(4)]
    assert [round(r.start, 7) for r in records] == [round(s, 7) for s in starts]
    assert timings.arrival == 999.0
    assert timings.first_scheduled == 1000.5  # admitted in the first step, before the runner ran
    assert round(timings.first_token, 7) == round(starts[1] + durations[1], 7)  # after the prompt's last chunk
    assert round(timings.last_token, 7) == round(timings.finished, 7) == round(starts[3] + durations[3], 7)
    assert timings.num_steps == 4


def test_step_records_are_bounded_when_nobody_drains_them() -> None:
    engine = make_engine()
    record = StepRecord(0, 0.0, 0.0, 0, 1, 1, 1, 0, 1, 64)
    engine._step_records.extend([record] * (MAX_STEP_RECORDS + 5))
    assert len(engine.take_step_records()) == MAX_STEP_RECORDS


def test_no_direct_clock_reads_in_the_scheduler_request_and_engine_core() -> None:
    for module in (scheduler, request, engine_core):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert not (isinstance(node.func.value, ast.Name) and node.func.value.id == "time"), (
                    f"{module.__name__} reads the clock directly: time.{node.func.attr}()"
                )


def test_records_count_the_context_each_step_attends_to() -> None:
    # budget 8: a 10-token prompt is chunked 8 + 2 (positions 0-7 attend to 8, 8-9 to 10), then each
    # decode step's token attends to everything before it and itself
    engine = make_engine(FakeClock())
    add(engine, "a", list(range(1, 11)), 3)
    run(engine)
    records = engine.take_step_records()
    assert [(r.num_prefill_tokens, r.num_decode_tokens, r.num_context_tokens) for r in records] == [
        (8, 0, 8), (2, 0, 10), (0, 1, 11), (0, 1, 12)]
    # query-key pairs of the prefill chunks: 1 + ... + 8, then 9 + 10 (the chunk over the first 8);
    # decode steps' attention is their context, counted above
    assert [r.num_prefill_attention_pairs for r in records] == [36, 19, 0, 0]

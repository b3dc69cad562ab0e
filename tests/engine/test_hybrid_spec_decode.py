"""N-gram speculative decoding on the tiny Qwen3.5 hybrid: after a step that verified drafts, each
sequence's recurrent state is the state after its accepted tokens alone, and float32 greedy outputs
are token for token those without speculation — batched with accepts and rejects in one step,
under preemption and abort, with structured output, and with prefix-cache state checkpoints over a
multi-turn chat.

The model's DeltaNet outputs are scaled up (``scale_qwen3_5_linear_outputs``) so that its next token
depends on the recurrent state: a state that kept rejected drafts changes the outputs here (keeping
all 1 + k positions' state instead of the accepted ones does)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.conftest import TinyQwen3_5
from tokenline import LLM, SamplingParams
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.model.batch import SampledToken, ScheduledBatch, ScheduledSeq, num_accepted_drafts
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import StructuredOutputs
from tokenline.spec_decode.ngram_proposer import NgramProposer

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
LINEAR_SCALE = 10.0  # the tiny hybrid's DeltaNet outputs, scaled up (see the module's docstring)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_5: TinyQwen3_5) -> LLM:
    return LLM(tiny_qwen3_5(linear_scale=LINEAR_SCALE), dtype="float32", max_num_seqs=8, num_kv_blocks=64,
               block_size=BLOCK)


@pytest.fixture(scope="module")
def runner(llm: LLM) -> ModelRunner:
    return llm.engine.runner


class RecordingRunner:
    """The real runner, noting per step each drafting sequence's (request id, drafts, accepted)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: list[list[tuple[str, int, int]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        out = self.runner.execute(batch)
        self.steps.append([
            (s.request_id, len(s.draft_token_ids), num_accepted_drafts(s.draft_token_ids, out[s.request_id]))
            for s in batch.seqs if s.draft_token_ids
        ])
        return out


def use_engine(
    llm: LLM, runner: ModelRunner, speculative: bool, num_blocks: int = 512, checkpoints: int = 0, max_seqs: int = 8
) -> RecordingRunner:
    runner.allocate_kv_cache(num_blocks, BLOCK, max_seqs + checkpoints)
    recorder = RecordingRunner(runner)
    llm.engine = EngineCore(
        recorder,
        KVCacheManager(num_blocks, BLOCK, True, num_state_slots=max_seqs, num_checkpoints=checkpoints,
                       checkpoint_interval=4 * BLOCK),
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048, max_model_len=4096),
        eos_token_ids=runner.config.eos_token_ids,
        check_integrity_every_step=True,
        proposer=NgramProposer(4, 1, 4) if speculative else None,
        grammar_compiler=llm.engine.grammar_compiler,  # the LLM's, carried from engine to engine
    )
    return recorder


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts where a pair (q, x) recurs with different runs of x after it: the model tends to
    repeat x, and the n-gram proposer drafts what followed the pair before, right or wrong."""
    rng = random.Random(seed)

    def noise(n: int) -> list[int]:
        return [rng.randrange(1000, 200000) for _ in range(n)]

    prompts = []
    for _ in range(count):
        q, x = noise(2)
        prompts.append(noise(5) + [q, x, x, x] + noise(4) + [q, x, x] + noise(3) + [q, x])
    return prompts


def assert_books_clean(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    llm.engine.scheduler.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and kv.state_slots == {}


def linear_states(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for cache in runner.kv_caches if isinstance(cache, tuple) for t in cache]


def test_a_verify_step_leaves_each_slot_at_its_accepted_tokens(runner: ModelRunner) -> None:
    """Three sequences verify 4 drafts in one step: 2 accepted, none, all 4. Each slot then holds
    what plain decoding of exactly the accepted tokens leaves (and a checkpoint taken inside the
    span, after the last known token, holds the state without any draft)."""
    runner.allocate_kv_cache(64, BLOCK, 12)
    greedy_params = GREEDY.with_defaults()  # resolved, as the engine hands them to the runner
    rng = random.Random(5)
    prompts = [[rng.randrange(1000, 200000) for _ in range(n)] for n in (9, 14, 6)]

    def table(first: int) -> list[int]:
        return list(range(first, first + 8))

    def step(*seqs: ScheduledSeq) -> dict[str, SampledToken]:
        return runner.execute(ScheduledBatch(list(seqs)))

    # Plain decoding in slots 3..5: the greedy continuation, and the state after each token.
    greedy: list[list[int]] = []
    states: list[list[list[torch.Tensor]]] = []  # [sequence][tokens decoded after the prompt]
    for i, prompt in enumerate(prompts):
        slot = 3 + i
        ids, after = [step(ScheduledSeq("p", prompt, 0, table(8 * slot), True, greedy_params, state_slot=slot))["p"].token_id], []
        after.append(linear_states(runner, slot))
        for n in range(4):
            pos = len(prompt) + n
            ids.append(step(ScheduledSeq("p", [ids[-1]], pos, table(8 * slot), True, greedy_params, state_slot=slot))["p"].token_id)
            after.append(linear_states(runner, slot))
        greedy.append(ids)
        states.append(after)

    drafts = [greedy[0][:2] + [7, 8], [9, *greedy[1][1:4]], greedy[2][:4]]
    for i, prompt in enumerate(prompts):  # everything but the last prompt token, in slots 0..2
        step(ScheduledSeq("p", prompt[:-1], 0, table(8 * i), False, greedy_params, state_slot=i))
    out = step(*(
        ScheduledSeq(f"r{i}", [prompt[-1], *drafts[i]], len(prompt) - 1, table(8 * i), True, greedy_params,
                     state_slot=i, draft_token_ids=drafts[i], state_checkpoints=[(1, 9 + i)])
        for i, prompt in enumerate(prompts)
    ))
    accepted = [num_accepted_drafts(drafts[i], out[f"r{i}"]) for i in range(3)]
    assert accepted == [2, 0, 4]
    for i in range(3):
        assert [out[f"r{i}"].token_id, *out[f"r{i}"].draft_targets][: accepted[i] + 1] == greedy[i][: accepted[i] + 1]
        for got, want in zip(linear_states(runner, i), states[i][accepted[i]], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for got, want in zip(linear_states(runner, 9 + i), states[i][0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_batched_greedy_outputs_match_with_accepts_and_rejects_in_one_step(llm: LLM, runner: ModelRunner) -> None:
    prompts = repetitive_prompts(6, seed=1)
    use_engine(llm, runner, speculative=False)
    expected = generate(llm, prompts)
    recorder = use_engine(llm, runner, speculative=True)
    assert generate(llm, prompts) == expected
    assert_books_clean(llm)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Some step verified drafts for several sequences where one kept some and another lost some.
    assert any(
        any(a > 0 for _, _, a in step) and any(a < k for _, k, a in step) and len(step) > 1
        for step in recorder.steps
    )


def test_preemption_and_abort_keep_outputs_and_books(llm: LLM, runner: ModelRunner) -> None:
    prompts = repetitive_prompts(5, seed=2)
    use_engine(llm, runner, speculative=False)
    expected = generate(llm, prompts)
    use_engine(llm, runner, speculative=True, num_blocks=40)  # prompts fit, not all outputs: preemptions
    assert generate(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_books_clean(llm)

    # Abort two requests mid-way (their slots go back and are reused); the others are unchanged.
    use_engine(llm, runner, speculative=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY.with_defaults()))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if step == 4:
            engine.abort_request("r1")
            engine.abort_request("r3")
    for i in (0, 2, 4):
        assert tokens[f"r{i}"] == expected[i]
    assert len(tokens["r1"]) < len(expected[1])
    assert_books_clean(llm)


def test_structured_outputs_with_drafts_match(llm: LLM, runner: ModelRunner) -> None:
    """Grammar-constrained greedy requests (drafts cut to what the grammar accepts, forced tokens
    appended unsampled) give the same tokens with speculation."""
    prompts = repetitive_prompts(4, seed=1)
    specs = [StructuredOutputs(regex=r"(abc|abd|xyz)( (abc|abd|xyz)){5,40}"),
             StructuredOutputs(choice=["alpha beta gamma alpha beta delta", "alpha beta gamma alpha beta gamma"])]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=specs[i % 2]) for i in range(4)]
    results = []
    for speculative in (False, True):
        use_engine(llm, runner, speculative=speculative)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert_books_clean(llm)
    assert results[0] == results[1]
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_multi_turn_with_state_checkpoints_matches_plain_decoding(llm: LLM, runner: ModelRunner) -> None:
    """Three conversations of three turns (each turn's prompt is the last one, its answer and a new
    repetitive message): with speculation and checkpoints, the same tokens as with neither, and
    later turns restore checkpoints."""

    def converse() -> list[list[int]]:
        history = repetitive_prompts(3, seed=3)
        outputs = []
        for turn in range(3):
            answers = generate(llm, history)
            outputs.extend(answers)
            follow_ups = repetitive_prompts(3, seed=10 + turn)
            history = [h + a + f for h, a, f in zip(history, answers, follow_ups, strict=True)]
        return outputs

    use_engine(llm, runner, speculative=False)
    expected = converse()
    use_engine(llm, runner, speculative=True, checkpoints=32)
    assert converse() == expected
    stats = llm.engine.stats()
    assert stats.state_checkpoint_hits >= 5 and stats.prefix_cache_hits > 0  # 5 without speculation too
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_books_clean(llm)

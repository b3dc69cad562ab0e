"""Prefix caching on the tiny Qwen3.5 hybrid through recurrent-state checkpoints: a checkpoint holds
exactly the state of its prefix, greedy outputs (float32) are the same with caching on and off,
multi-turn chats reuse nearly what the KV blocks alone would, short prompts hit, and preemption,
abort and a tiny checkpoint pool keep every book straight."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.conftest import TinyQwen3_5
from tokenline import LLM, SamplingParams
from tokenline.engine.config import EngineConfig
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.engine.state_checkpoints import StateCheckpointPool
from tokenline.model.batch import ScheduledBatch, ScheduledSeq

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
TOPICS = ["Kyoto", "the Rhine", "volcanoes", "sourdough", "chess openings", "tides"]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_5: TinyQwen3_5) -> LLM:
    return LLM(tiny_qwen3_5(), dtype="float32", max_num_seqs=8, num_kv_blocks=64, block_size=BLOCK)


def use_engine(
    llm: LLM, checkpoints: int, interval: int = 4 * BLOCK, num_blocks: int = 1024, budget: int = 2048, max_seqs: int = 8
) -> None:
    """A fresh engine on the loaded weights: ``checkpoints`` state checkpoint slots (0: no caching)."""
    runner = llm.engine.runner
    runner.allocate_kv_cache(num_blocks, BLOCK, max_seqs + checkpoints)
    llm.engine = EngineCore(
        runner,
        KVCacheManager(num_blocks, BLOCK, True, num_state_slots=max_seqs, num_checkpoints=checkpoints,
                       checkpoint_interval=interval),
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096),
        eos_token_ids=runner.config.eos_token_ids,
        check_integrity_every_step=True,
    )


def conversations(llm: LLM, turns: int, count: int = 3) -> tuple[list[list[int]], list[int]]:
    """``count`` chats of ``turns`` turns each, turn by turn (all chats' turn k in one batch): every
    turn's greedy output token ids, and each turn's prompt length."""
    rng = random.Random(7)
    system = {"role": "system", "content": "You are a terse travel and science guide. " * 3}
    chats: list[list[dict[str, str]]] = [[system] for _ in range(count)]
    outputs, prompt_lens = [], []
    for _ in range(turns):
        for chat in chats:
            words = " ".join(rng.choice(TOPICS) for _ in range(rng.randrange(3, 12)))
            chat.append({"role": "user", "content": f"Tell me about {words}."})
        for chat, result in zip(chats, llm.chat(chats, GREEDY), strict=True):
            chat.append({"role": "assistant", "content": result.outputs[0].text})
            outputs.append(result.outputs[0].token_ids)
            prompt_lens.append(len(result.prompt_token_ids))
    return outputs, prompt_lens


def assert_books_clean(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    llm.engine.scheduler.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and kv.state_slots == {}
    assert kv.checkpoints is None or (kv.checkpoints._tails == {} and not kv.checkpoints._pending)


def test_a_checkpoint_inside_a_chunk_holds_the_state_of_its_prefix_alone(llm: LLM) -> None:
    runner = llm.engine.runner
    runner.allocate_kv_cache(32, BLOCK, 6)
    tokens = random.Random(1).sample(range(1000, 200000), 150)

    def prefill(ids: list[int], slot: int, first_block: int, checkpoints: list[tuple[int, int]]) -> None:
        table = list(range(first_block, first_block + -(-len(ids) // BLOCK)))
        seq = ScheduledSeq("r", ids, 0, table, False, GREEDY, state_slot=slot, state_checkpoints=checkpoints)
        runner.execute(ScheduledBatch([seq]))

    prefill(tokens, 0, 0, [(64, 4), (128, 5), (150, 3)])  # two inside the chunk, one at its end
    prefill(tokens[:64], 1, 10, [])
    prefill(tokens[:128], 2, 20, [])
    linear = [cache for cache in runner.kv_caches if isinstance(cache, tuple)]
    assert len(linear) == 3
    for conv, recurrent in linear:
        for checkpoint, alone in ((4, 1), (5, 2), (3, 0)):
            torch.testing.assert_close(conv[checkpoint], conv[alone], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(recurrent[checkpoint], recurrent[alone], rtol=1e-5, atol=1e-6)


def test_spans_prefilled_together_take_the_same_checkpoints_as_alone(llm: LLM) -> None:
    runner = llm.engine.runner
    runner.allocate_kv_cache(40, BLOCK, 8)
    rng = random.Random(4)
    a, b = rng.sample(range(1000, 200000), 150), rng.sample(range(1000, 200000), 90)

    def seq(ids: list[int], slot: int, first_block: int, checkpoints: list[tuple[int, int]]) -> ScheduledSeq:
        table = list(range(first_block, first_block + -(-len(ids) // BLOCK)))
        return ScheduledSeq(f"r{slot}", ids, 0, table, False, GREEDY, state_slot=slot, state_checkpoints=checkpoints)

    # Together: one batched chunked rule over both spans (checkpoints at 48 and 112 are off the
    # 64-token chunk grid), then each alone.
    runner.execute(ScheduledBatch([seq(a, 0, 0, [(48, 4), (112, 5)]), seq(b, 1, 10, [(64, 6)])]))
    runner.execute(ScheduledBatch([seq(a[:48], 2, 20, [(48, 7)])]))
    runner.execute(ScheduledBatch([seq(a[:112], 3, 24, [])]))
    for conv, recurrent in (c for c in runner.kv_caches if isinstance(c, tuple)):
        for together, alone in ((4, 7), (5, 3)):
            torch.testing.assert_close(conv[together], conv[alone], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(recurrent[together], recurrent[alone], rtol=1e-5, atol=1e-5)
    runner.execute(ScheduledBatch([seq(b, 2, 20, []), seq(a, 3, 30, [])]))  # together again, no checkpoints
    for conv, recurrent in (c for c in runner.kv_caches if isinstance(c, tuple)):
        torch.testing.assert_close(recurrent[1], recurrent[2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(recurrent[0], recurrent[3], rtol=1e-5, atol=1e-5)


def test_multi_turn_greedy_outputs_match_without_caching_and_hits_approach_pure_kv(llm: LLM) -> None:
    use_engine(llm, checkpoints=0)
    assert not llm.engine.kv_cache.enable_prefix_caching
    reference, _ = conversations(llm, turns=4)
    assert llm.engine.stats().prefix_cache_hits == 0

    use_engine(llm, checkpoints=64)
    cached, prompt_lens = conversations(llm, turns=4)
    assert cached == reference
    stats = llm.engine.stats()
    # The KV blocks alone matched kv_matched tokens: what a pure-attention model of this shape and
    # pool reuses on the same token streams. Checkpoints keep at least 80 % of it.
    assert stats.prefix_cache_hits >= 0.8 * stats.prefix_cache_kv_matched > 0
    assert stats.state_checkpoint_hits >= 9  # every chat's turns 2-4
    assert max(prompt_lens) < 512  # short prompts hit: no block-size cliff
    assert_books_clean(llm)


def test_a_repeated_short_prompt_hits_up_to_its_last_block(llm: LLM) -> None:
    use_engine(llm, checkpoints=16)
    prompt = random.Random(2).sample(range(1000, 200000), 45)  # under three blocks
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert llm.engine.stats().state_checkpoint_hits == 1


def test_preemption_abort_and_a_tiny_checkpoint_pool_keep_outputs_and_books(llm: LLM) -> None:
    rng = random.Random(5)
    shared = rng.sample(range(1000, 200000), 70)
    prompts = [shared + rng.sample(range(1000, 200000), n) for n in (9, 30, 51, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    use_engine(llm, checkpoints=0)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    # 20 blocks: the prompts are admitted but their outputs do not all fit (preemptions); two
    # checkpoint slots: saves evict each other; a chunk budget of 61 tokens splits prefills off-block.
    use_engine(llm, checkpoints=2, num_blocks=20, budget=61)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.state_checkpoint_hits > 0
    assert stats.num_state_checkpoints_used <= 2
    assert_books_clean(llm)

    # Aborted mid-prefill and mid-decode: a stop string ends requests early, the rest still match.
    stopping = [SamplingParams(temperature=0.8, seed=i, max_tokens=28, stop=["a", "e"]) for i in range(4)]
    llm.generate(prompts, stopping)
    assert not llm.engine.scheduler.has_unfinished()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    assert_books_clean(llm)


def test_checkpoint_pool_lru_tails_pins_and_pending_saves() -> None:
    pool = StateCheckpointPool(num_slots=3, interval=64)
    a = pool.plan_save(b"a64", "r", 64, tail=False)
    assert a is not None and pool.lookup(b"a64") is None  # not findable before the step ran
    assert pool.plan_save(b"a64", "q", 64, tail=False) is None  # planned once
    pool.commit()
    assert pool.lookup(b"a64") == a
    pool.plan_save(b"a80", "r", 80, tail=True)
    pool.commit()
    pool.plan_save(b"a96", "r", 96, tail=True)  # the deeper tail replaces the old one
    pool.commit()
    assert pool.lookup(b"a80") is None and pool.lookup(b"a96") is not None and pool.num_used == 2
    pool.forget_request("r")  # the finished sequence's tail stays, as an ordinary checkpoint
    restored = pool.restore(b"a64", 64)  # pinned: this step's saves cannot evict it
    pool.plan_save(b"x", "s", 16, tail=False)
    evicted = pool.plan_save(b"y", "s", 32, tail=False)  # full: evicts the LRU unpinned one (a96)
    assert evicted is not None and evicted != restored and pool.plan_save(b"z", "s", 48, tail=False) is None
    pool.commit()
    assert pool.lookup(b"a96") is None and pool.lookup(b"a64") == restored
    pool.check_integrity()
    pool.clear()
    assert pool.num_used == 0
    pool.check_integrity()


def test_interval_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ValueError, match="multiple of the block size"):
        EngineConfig(block_size=16, hybrid_state_checkpoint_interval=40).validate()
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(hybrid_state_checkpoints=-1).validate()
    EngineConfig(block_size=16, hybrid_state_checkpoint_interval=32).validate()


def test_build_engine_sizes_the_checkpoint_pool(llm: LLM, tmp_path: Path) -> None:
    from tokenline.engine.factory import build_engine_core

    engine = build_engine_core(EngineConfig(dtype="float32", max_num_seqs=4, num_kv_blocks=64,
                                            hybrid_state_checkpoints=5), llm.model_dir)
    assert engine.kv_cache.num_checkpoints == 5 and engine.kv_cache.enable_prefix_caching
    conv, recurrent = next(c for c in engine.runner.kv_caches if isinstance(c, tuple))
    assert conv.shape[0] == recurrent.shape[0] == 4 + 5
    engine = build_engine_core(EngineConfig(dtype="float32", max_num_seqs=4, num_kv_blocks=64,
                                            hybrid_state_checkpoints=0), llm.model_dir)
    assert engine.kv_cache.checkpoints is None and not engine.kv_cache.enable_prefix_caching


def test_a_budget_the_states_fill_is_refused_with_what_took_it(llm: LLM) -> None:
    """Recurrent states come out of --kv-cache-memory first; when they leave no KV block the error
    names them and the flags that change them (a 0.8 B hybrid's 128 default slots need 2.3 GiB)."""
    from tokenline.engine.factory import build_engine_core

    with pytest.raises(ValueError, match=r"no KV cache block after this hybrid model's recurrent states: "
                                         r"64 sequence slots \(--max-num-seqs\) and 0 prefix-cache"):
        build_engine_core(EngineConfig(dtype="float32", max_num_seqs=64, kv_cache_memory_gib=0.001,
                                       hybrid_state_checkpoints=0), llm.model_dir)


def test_a_salted_prompt_restores_only_checkpoints_of_its_salt(llm: LLM) -> None:
    """A hybrid model's prefix cache is its state checkpoints, keyed by the salted block hashes:
    another tenant's salt finds none of them."""
    use_engine(llm, checkpoints=16)
    prompt = random.Random(3).sample(range(1000, 200000), 45)  # under three blocks
    params = SamplingParams(max_tokens=2, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)

    def cached(request_id: str, salt: str) -> int:
        llm.engine.add_request(EngineRequest(request_id, prompt, params, cache_salt=salt))
        hits = []
        while llm.engine.has_unfinished_requests():
            hits += [o.num_cached_tokens for o in llm.engine.step()]
        return max(hits)

    assert cached("alice-1", "alice") == 0
    assert cached("bob", "bob") == 0
    assert cached("alice-2", "alice") == 32
    assert llm.engine.stats().state_checkpoint_hits == 1
    assert_books_clean(llm)

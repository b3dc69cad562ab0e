"""The block pool and KV cache manager on their own: no model, no scheduler."""

from __future__ import annotations

import pytest

from tokenline.engine.block_pool import BlockPool, hash_block
from tokenline.engine.kv_cache_manager import KVCacheManager
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

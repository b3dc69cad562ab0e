"""The pool of fixed-size KV cache blocks, with reference counts and a prefix-cache index.

A block is *free* when no request holds it (ref count 0). A free block may still carry cached KV
for a token prefix: it stays findable by its hash until it is handed out again. Requests sharing
a cached prefix share its blocks through the ref count.

Which free block is handed out (the rule memory follows): the pool tensor is allocated but not
touched, so only blocks that were ever written are resident. ``allocate`` takes, in order,

1. *spare* blocks: touched before, free, holding no findable prefix (most recently freed first,
   still warm in the CPU caches) — reusing them costs nothing;
2. *fresh* blocks, never touched, in ascending id order (the resident part of the pool is the
   prefix of ids below :attr:`BlockPool.num_touched_blocks`);
3. *cached* free blocks, least recently freed first (LRU), each eviction recorded as
   ``BlockRemoved``.

Steps 2 and 3 trade memory for prefix hits. ``cache_resident_blocks`` says where: while fewer
blocks than that were ever touched, 2 comes before 3 (the prefix cache grows into fresh memory);
from there on 3 comes before 2, so the pool becomes resident up to that many blocks or the peak in
use at once, whichever is larger. None (the pool's default, ``--prefix-cache-fills-pool``): the
whole pool, so traffic with little reuse makes all of it resident in the end; 0
(``--no-prefix-cache-fills-pool``): the peak in use alone, the prefix cache keeping only what fits
beside it. The engine's default bounds it by ``--prefix-cache-resident-memory``.

With ``enable_kv_cache_events`` the pool records, in vLLM's shape, every hash it makes findable
(``BlockStored``), every hash it forgets on eviction (``BlockRemoved``) and every reset
(``AllBlocksCleared``); the engine drains them with :meth:`BlockPool.take_events`. Replaying them
yields exactly the keys of the pool's hash index. Torch-free: routers hash prompts with this module.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tokenline.engine.kv_events import KVCacheEvent, KVEventRecorder

# A cache index key: a block hash (KV cache group 0), or (group, hash) for another group's copy of
# the same prefix block (models with sliding-window layers: kv_cache_manager.py). Events name group
# 0's blocks only, so their wire format is the same whatever groups a model has.
CacheKey = bytes | tuple[int, bytes]


def cache_key(block_hash: bytes, group: int = 0) -> CacheKey:
    return block_hash if group == 0 else (group, block_hash)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Key of a full block: chained on its parent's key, so equal keys mean equal whole prefixes."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def salt_root(salt: str | None) -> bytes | None:
    """What a salted sequence's first block is chained on instead of nothing (vLLM's ``cache_salt``
    is likewise folded into the first block's key only): every later key descends from it, so two
    salts never share a block. A router that knows the salt computes the same keys."""
    if salt is None:
        return None
    return hashlib.sha256(b"tokenline cache salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = False,
        cache_resident_blocks: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if cache_resident_blocks is not None and cache_resident_blocks < 0:
            raise ValueError(f"cache_resident_blocks must be >= 0, got {cache_resident_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Fresh blocks come before evicting cached prefixes while fewer than this many are touched.
        self.cache_resident_blocks = num_blocks if cache_resident_blocks is None else min(cache_resident_blocks, num_blocks)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[CacheKey | None] = [None] * num_blocks
        # The three kinds of free block (see the module docstring). Dicts give O(1) removal of a
        # block a new request revives; _spare pops its newest, _lru its oldest.
        self._spare: dict[int, None] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._num_touched = 0  # blocks [0, _num_touched) were handed out at least once
        self._cached: dict[CacheKey, int] = {}
        # Off unless someone drains them: an undrained recorder would grow for ever.
        self._events = KVEventRecorder() if enable_kv_cache_events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._spare) + len(self._lru) + self.num_blocks - self._num_touched

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out: the resident part of the pool's memory (a high-water mark)."""
        return self._num_touched

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes, group: int = 0) -> int | None:
        return self._cached.get(cache_key(block_hash, group)) if self.enable_prefix_caching else None

    def is_free(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` blocks: spare ones, then cached (evicted, LRU) or fresh ones in the
        order the policy says (module docstring)."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks with only {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            block_id = self._next_block()
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def _next_block(self) -> int:
        if self._spare:
            return self._spare.popitem()[0]
        if self._lru and self._num_touched >= self.cache_resident_blocks:
            block_id, _ = self._lru.popitem(last=False)
            self._evict(block_id)
            return block_id
        self._num_touched += 1
        return self._num_touched - 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take another reference on cached blocks a new request reuses."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                if block_id in self._lru:
                    del self._lru[block_id]
                else:
                    del self._spare[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Callers pass a request's table tail-first so that
        the end of a sequence, the least likely to be shared, is evicted before its prefix."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is None:
                    self._spare[block_id] = None
                else:
                    self._lru[block_id] = None

    def cached_hashes(self) -> set[bytes]:
        """The hashes findable right now (what a consumer of the events must arrive at)."""
        return {key for key in self._cached if isinstance(key, bytes)}

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call (none when events are off)."""
        return self._events.take() if self._events is not None else []

    def cache(
        self, block_id: int, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
        salt: str | None = None, group: int = 0,
    ) -> None:
        """Make a block that now holds a full, computed prefix block findable by its hash (in KV
        cache group ``group``).

        ``parent_hash``, ``token_ids`` (the block's tokens) and ``salt`` (a sequence's first block's
        cache salt) only feed the ``BlockStored`` event.
        """
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        key = cache_key(block_hash, group)
        # If an identical block is already indexed (two requests computed the same prefix at
        # once), keep the first; this block simply stays uncached.
        if key in self._cached:
            return
        self.block_hash[block_id] = key
        self._cached[key] = block_id
        if self._events is not None and group == 0:
            self._events.stored(block_hash, parent_hash, token_ids, salt)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data but are no longer findable)."""
        for block_hash, block_id in list(self._cached.items()):
            self.block_hash[block_id] = None
            del self._cached[block_hash]
        # Free blocks that held a prefix now hold nothing findable: spare, reused first.
        while self._lru:
            self._spare[self._lru.popitem(last=False)[0]] = None
        if self._events is not None:
            self._events.cleared()

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hash[block_id] = None
            if self._events is not None and isinstance(block_hash, bytes):
                self._events.removed(block_hash)

    def check_integrity(self, tables: Iterable[Sequence[int]]) -> None:
        """Raise if the pool's books disagree with the block tables that hold its blocks.

        free + used == total; each ref count equals the number of tables holding the block; no
        table holds a block twice; every cached hash points at a block that carries it.
        """
        holders = [0] * self.num_blocks
        for table in tables:
            if len(set(table)) != len(table):
                raise AssertionError(f"a block table holds a block twice: {list(table)}")
            for block_id in table:
                holders[block_id] += 1
        if holders != self.ref_counts:
            bad = [i for i in range(self.num_blocks) if holders[i] != self.ref_counts[i]]
            raise AssertionError(f"ref counts disagree with block tables for blocks {bad[:10]}")
        free = {i for i in range(self.num_blocks) if self.ref_counts[i] == 0}
        listed = [*self._spare, *self._lru, *range(self._num_touched, self.num_blocks)]
        if free != set(listed) or len(listed) != len(free):
            raise AssertionError("free lists disagree with ref counts")
        if any(self.block_hash[i] is None for i in self._lru) or any(self.block_hash[i] for i in self._spare):
            raise AssertionError("a free block is listed as cached without a hash, or as spare with one")
        for block_hash, block_id in self._cached.items():
            if self.block_hash[block_id] != block_hash:
                raise AssertionError(f"cache index points at block {block_id} with another hash")

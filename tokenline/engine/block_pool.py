"""The pool of fixed-size KV cache blocks, with reference counts and a prefix-cache index.

A block is *free* when no request holds it (ref count 0). A free block may still carry cached KV
for a token prefix: it stays findable by its hash until it is handed out again, oldest-freed
first (LRU). Requests sharing a cached prefix share its blocks through the ref count.

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


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Key of a full block: chained on its parent's key, so equal keys mean equal whole prefixes."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order (front = evicted first). OrderedDict gives O(1) removal
        # of a cached block that a new request revives.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        # Off unless someone drains them: an undrained recorder would grow for ever.
        self._events = KVEventRecorder() if enable_kv_cache_events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def is_free(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` blocks, evicting the least recently freed cached ones."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with only {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take another reference on cached blocks a new request reuses."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Callers pass a request's table tail-first so that
        the end of a sequence, the least likely to be shared, is evicted before its prefix."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def cached_hashes(self) -> set[bytes]:
        """The hashes findable right now (what a consumer of the events must arrive at)."""
        return set(self._cached)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call (none when events are off)."""
        return self._events.take() if self._events is not None else []

    def cache(self, block_id: int, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        """Make a block that now holds a full, computed prefix block findable by its hash.

        ``parent_hash`` and ``token_ids`` (the block's tokens) only feed the ``BlockStored`` event.
        """
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        # If an identical block is already indexed (two requests computed the same prefix at
        # once), keep the first; this block simply stays uncached.
        if block_hash in self._cached:
            return
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self._events is not None:
            self._events.stored(block_hash, parent_hash, token_ids)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data but are no longer findable)."""
        for block_hash, block_id in list(self._cached.items()):
            self.block_hash[block_id] = None
            del self._cached[block_hash]
        if self._events is not None:
            self._events.cleared()

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hash[block_id] = None
            if self._events is not None:
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
        used = self.num_blocks - len(free)
        if free != set(self._free) or len(self._free) + used != self.num_blocks:
            raise AssertionError("free list disagrees with ref counts")
        for block_hash, block_id in self._cached.items():
            if self.block_hash[block_id] != block_hash:
                raise AssertionError(f"cache index points at block {block_id} with another hash")

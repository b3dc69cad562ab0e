"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing.

The scheduler asks yes/no questions ("can this request's next tokens get blocks?") and hands
over ``Request`` objects; the block ids it gets back are opaque handles it passes to the runner.

Models with sliding-window layers have several KV cache groups sharing the one pool
(model/kv_groups.py), each with its own table per request. A sliding group's table keeps only
the blocks the window can still see: before each step, blocks wholly older than ``window - 1``
positions before the step's first query go back to the pool and their entries become
:data:`NULL_BLOCK`. A prefix hit there needs only the blocks the window covers at the hit point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenline.engine.block_pool import BlockPool, hash_block, salt_root
from tokenline.engine.request import Request
from tokenline.engine.state_checkpoints import StateCheckpointPool
from tokenline.model.kv_groups import sliding_blocks_needed

# A sliding group's table entry for a block its window no longer sees (returned to the pool).
NULL_BLOCK = -1


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission
    hits: int = 0  # of those, tokens found in the cache
    # Hybrid models: tokens the KV blocks alone matched, before the cut back to the deepest state
    # checkpoint (what a pure-attention model with this pool would have reused).
    kv_matched: int = 0


@dataclass
class PrefixHit:
    """A cached prefix found for a model with several KV cache groups: per group, the blocks that
    hold it (a sliding group's :data:`NULL_BLOCK` where its window no longer looks). Its length is
    the prefix's length in blocks, like the plain list of a one-group model."""

    groups: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.groups[0]) if self.groups else 0


CachedBlocks = Sequence[int] | PrefixHit


class KVCacheManager:
    """Block tables for full-attention KV, and — for hybrid models — one recurrent-state slot per
    running sequence (linear-attention layers keep a fixed-size state instead of per-token KV) and
    a pool of state checkpoints that make prefix caching work for them (``state_checkpoints.py``).

    State slot numbering, shared with the runner: running sequences use ``0 .. num_state_slots-1``,
    checkpoints ``num_state_slots .. num_state_slots + num_checkpoints - 1``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        enable_kv_cache_events: bool = False,
        num_checkpoints: int = 0,
        checkpoint_interval: int = 0,
        cache_resident_blocks: int | None = None,
        group_windows: Sequence[int | None] = (None,),
        max_chunk_tokens: int | None = None,
    ) -> None:
        """``group_windows``: per KV cache group, its sliding window (None: full attention); one
        full group by default. ``max_chunk_tokens``: the most tokens a step computes for one
        sequence (the scheduler's budget), bounding what admission counts for a sliding group."""
        if not group_windows:
            raise ValueError("the KV cache needs at least one group")
        if (len(group_windows) > 1 or group_windows[0] is not None) and num_state_slots:
            raise ValueError("sliding-window groups beside recurrent state slots are not supported")
        self.group_windows = list(group_windows)
        self.max_chunk_tokens = max_chunk_tokens
        # A cached KV prefix alone is useless to a hybrid model (its linear layers' state never saw
        # those tokens): prefix caching there needs state checkpoints.
        enable_prefix_caching = enable_prefix_caching and (num_state_slots == 0 or num_checkpoints > 0)
        self.checkpoints: StateCheckpointPool | None = None
        if num_state_slots and enable_prefix_caching:
            interval = checkpoint_interval or 4 * block_size
            if interval % block_size:
                raise ValueError(f"the state checkpoint interval ({interval}) must be a multiple of the block size")
            self.checkpoints = StateCheckpointPool(num_checkpoints, interval)
        self._restores: dict[str, int] = {}  # request id -> checkpoint slot to restore this step
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, enable_kv_cache_events, cache_resident_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_state_slots = num_state_slots
        self._free_slots = list(range(num_state_slots - 1, -1, -1))
        self.state_slots: dict[str, int] = {}
        # Per request, one table per group; ``tables`` holds group 0's (the same lists).
        self.group_tables: dict[str, list[list[int]]] = {}
        self.tables: dict[str, list[int]] = {}
        self._num_indexed: dict[str, int] = {}  # leading blocks of a table already in the cache index
        self.prefix_stats = PrefixCacheStats()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for_sequence(self, num_tokens: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds at once, every group counted
        (what admission asks of an empty pool)."""
        total = 0
        for window in self.group_windows:
            need = self.blocks_for(num_tokens)
            if window is not None and self.max_chunk_tokens:
                need = min(need, sliding_blocks_needed(window, self.block_size, self.max_chunk_tokens))
            total += need
        return total

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def grouped(self) -> bool:
        """Whether tables go per group (several groups, or sliding windows): else one plain table."""
        return len(self.group_windows) > 1 or self.group_windows[0] is not None

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's table for the request (``NULL_BLOCK`` where a window let a block go)."""
        return self.group_tables.get(request_id, [])

    def num_blocks_held(self, request_id: str) -> int:
        """Pool blocks the request's tables hold, every group counted."""
        return sum(b != NULL_BLOCK for table in self.block_tables(request_id) for b in table)

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_state_slots_used(self) -> int:
        return len(self.state_slots)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens.

        Never the whole sequence: the last token is always recomputed so that there are logits
        to sample the next token from.
        """
        if not self.enable_prefix_caching:
            return []
        self._hash_full_blocks(request)
        if request.sampling.prompt_logprobs is not None:
            return []  # it scores every prompt position, so it computes them all (as vLLM)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.grouped:
            return self._find_cached_prefix_groups(request, max_blocks)
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        if self.checkpoints is not None:
            # Only usable up to the deepest matched block whose end has a state checkpoint.
            matched = len(blocks)
            while blocks and self.checkpoints.lookup(request.block_hashes[len(blocks) - 1]) is None:
                blocks.pop()
            request.kv_matched_tokens = matched * self.block_size
        return blocks

    def _find_cached_prefix_groups(self, request: Request, max_blocks: int) -> PrefixHit:
        """The longest prefix every group can serve: full groups need all its blocks, sliding ones
        only those their window covers from the hit point (where the first new token sits)."""
        hashes = request.block_hashes[:max_blocks]
        found = [[self.pool.lookup(h, g) for h in hashes] for g in range(self.num_groups)]
        depth = max_blocks
        for g, window in enumerate(self.group_windows):
            if window is None:
                depth = min(depth, next((i for i, b in enumerate(found[g]) if b is None), len(hashes)))
        while depth > 0 and not all(
            all(b is not None for b in found[g][self._first_visible(g, depth * self.block_size) : depth])
            for g, window in enumerate(self.group_windows) if window is not None
        ):
            depth -= 1
        groups = []
        for g in range(self.num_groups):
            first = self._first_visible(g, depth * self.block_size)
            groups.append([NULL_BLOCK] * first + [b for b in found[g][first:depth]])  # type: ignore[misc]
        return PrefixHit(groups)

    def _first_visible(self, group: int, position: int) -> int:
        """The first block a query at ``position`` (or later) still sees in this group."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def can_fit(self, request: Request, num_tokens: int, cached_blocks: CachedBlocks = ()) -> bool:
        """Whether the request could hold ``num_tokens`` tokens of KV, reusing ``cached_blocks``
        (and, for a hybrid model, whether a state slot is free for it)."""
        if self.num_state_slots and request.request_id not in self.state_slots and not self._free_slots:
            return False
        return self._blocks_missing(request, num_tokens, cached_blocks) <= self.pool.num_free_blocks

    def state_slot(self, request_id: str) -> int | None:
        return self.state_slots.get(request_id)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: CachedBlocks = ()) -> bool:
        """Grow the request's table to hold its computed tokens plus ``num_new_tokens``.

        ``cached_blocks`` (only for a request with nothing computed yet) are prefix blocks found by
        :meth:`find_cached_prefix`; they are shared, not copied. Returns False, changing nothing,
        when the pool cannot supply the blocks.
        """
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        if not self.can_fit(request, total, cached_blocks):
            return False
        if self.grouped:
            self._allocate_groups(request, total, cached_blocks)
            return True
        table = self.tables.setdefault(request.request_id, [])
        self.group_tables.setdefault(request.request_id, [table])
        if self.num_state_slots and request.request_id not in self.state_slots:
            # A fresh slot: the model starts its state from zero at the sequence's first chunk.
            self.state_slots[request.request_id] = self._free_slots.pop()
        if cached_blocks:
            assert not table, "cached prefix blocks can only start an empty table"
            if self.checkpoints is not None:
                num_cached = len(cached_blocks) * self.block_size
                block_hash = request.block_hashes[len(cached_blocks) - 1]
                self._restores[request.request_id] = self.checkpoint_base + self.checkpoints.restore(
                    block_hash, num_cached
                )
            self.pool.touch(cached_blocks)
            table.extend(cached_blocks)
            self._num_indexed[request.request_id] = len(cached_blocks)
        table.extend(self.pool.allocate(max(0, self.blocks_for(total) - len(table))))
        return True

    def _allocate_groups(self, request: Request, total: int, cached_blocks: CachedBlocks) -> None:
        rid = request.request_id
        tables = self.group_tables.setdefault(rid, [[] for _ in self.group_windows])
        self.tables[rid] = tables[0]
        if len(cached_blocks):
            assert isinstance(cached_blocks, PrefixHit) and not tables[0], "cached blocks only start empty tables"
            for table, hit in zip(tables, cached_blocks.groups, strict=True):
                self.pool.touch(b for b in hit if b != NULL_BLOCK)
                table.extend(hit)
            self._num_indexed[rid] = len(cached_blocks)
        start = request.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = self.blocks_for(total)
        for g, table in enumerate(tables):
            first = self._first_visible(g, start)
            # Out of the window for every query from here on: back to the pool (tail first, as free() does).
            gone = _leaving(table, first)
            self.pool.free(table[i] for i in gone)
            for i in gone:
                table[i] = NULL_BLOCK
            table.extend([NULL_BLOCK] * max(0, first - len(table)))
            table.extend(self.pool.allocate(max(0, needed - len(table))))

    def record_admission(self, num_query_tokens: int, num_hit_tokens: int, num_kv_matched: int = 0) -> None:
        self.prefix_stats.queries += num_query_tokens
        self.prefix_stats.hits += num_hit_tokens
        self.prefix_stats.kv_matched += max(num_hit_tokens, num_kv_matched)

    # --- hybrid models: state checkpoints ------------------------------------------------------

    @property
    def checkpoint_base(self) -> int:
        """The state-slot index of checkpoint slot 0 (checkpoints follow the running slots)."""
        return self.num_state_slots

    @property
    def num_checkpoints(self) -> int:
        return self.checkpoints.num_slots if self.checkpoints is not None else 0

    def take_restore(self, request_id: str) -> int | None:
        """The checkpoint slot to copy into the request's state slot before this step, if any."""
        return self._restores.pop(request_id, None)

    def plan_checkpoints(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """Checkpoints to take while this step computes the request's tokens ``start .. end``:
        (tokens into the chunk, state slot) pairs. Block boundaries in the chunk on the interval and
        at the end of the prompt are kept; the deepest boundary otherwise becomes the sequence's tail."""
        pool = self.checkpoints
        if pool is None:
            return []
        size = self.block_size
        self._hash_full_blocks(request)
        prompt = request.num_prompt_tokens
        # Where an exact repeat of the prompt is cut (its last token is always recomputed), and the
        # prompt's last block boundary (where the next turn of a conversation continues from).
        prompt_ends = {(prompt - 1) // size * size, prompt // size * size}
        deepest = end // size * size
        saves = []
        for depth in range(start // size * size + size, deepest + 1, size):
            keep = depth % pool.interval == 0 or depth in prompt_ends
            if not keep and depth != deepest:
                continue
            slot = pool.plan_save(request.block_hashes[depth // size - 1], request.request_id, depth, tail=not keep)
            if slot is not None:
                saves.append((depth - start, self.checkpoint_base + slot))
        return saves

    def commit_checkpoints(self) -> None:
        """The step ran: its checkpoints become findable and the ones it restored unpinned."""
        if self.checkpoints is not None:
            self.checkpoints.commit()
        self._restores.clear()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that became full and computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        tables = self.group_tables.get(request.request_id)
        if not tables or not tables[0]:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        start = self._num_indexed.get(request.request_id, 0)
        if num_full <= start:
            return
        self._hash_full_blocks(request)
        hashes, size = request.block_hashes, self.block_size
        for index in range(start, num_full):
            parent = hashes[index - 1] if index else None
            salt = None if index else request.cache_salt
            for group, table in enumerate(tables):
                if table[index] != NULL_BLOCK:
                    self.pool.cache(table[index], hashes[index], parent,
                                    request.token_ids[index * size : (index + 1) * size], salt, group)
        self._num_indexed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        self.tables.pop(request.request_id, None)
        for table in self.group_tables.pop(request.request_id, []):
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        self._num_indexed.pop(request.request_id, None)
        slot = self.state_slots.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        if self.checkpoints is not None:
            self.checkpoints.forget_request(request.request_id)

    def check_integrity(self) -> None:
        self.pool.check_integrity(
            [b for b in table if b != NULL_BLOCK] for tables in self.group_tables.values() for table in tables
        )
        if any(tables[0] is not self.tables.get(rid) for rid, tables in self.group_tables.items()) or (
            set(self.tables) != set(self.group_tables)
        ):
            raise AssertionError("group 0's tables and the request tables disagree")
        for tables in self.group_tables.values():
            for g, table in enumerate(tables):
                window = self.group_windows[g]
                nulls = table.count(NULL_BLOCK)
                # Freed entries form a prefix (the window only moves on): what the counts rely on.
                if (window is None and nulls) or NULL_BLOCK in table[nulls:] or len(table) != len(tables[0]):
                    raise AssertionError(f"group {g}'s table has a hole or another length: {table}")
        held = list(self.state_slots.values())
        if len(set(held)) != len(held) or sorted(held + self._free_slots) != list(range(self.num_state_slots)):
            raise AssertionError("state slots: a slot is held twice or lost")
        if set(self.state_slots) - set(self.tables):
            raise AssertionError("a request holds a state slot but no blocks")
        if self.checkpoints is not None:
            self.checkpoints.check_integrity()

    def _blocks_missing(self, request: Request, num_tokens: int, cached_blocks: CachedBlocks) -> int:
        if self.grouped:
            return self._blocks_missing_groups(request, num_tokens, cached_blocks)
        have = len(self.tables.get(request.request_id, ())) + len(cached_blocks)
        new = max(0, self.blocks_for(num_tokens) - have)
        # Reviving a cached block that sits in the free list takes it out of the free count too.
        revived = sum(1 for block_id in cached_blocks if self.pool.is_free(block_id))  # type: ignore[union-attr]
        return new + revived

    def _blocks_missing_groups(self, request: Request, num_tokens: int, cached_blocks: CachedBlocks) -> int:
        """Blocks the pool must hand out, less those the request's sliding groups give back first."""
        hit = cached_blocks.groups if isinstance(cached_blocks, PrefixHit) else [[] for _ in self.group_windows]
        tables = self.group_tables.get(request.request_id) or [[] for _ in self.group_windows]
        start = request.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = self.blocks_for(num_tokens)
        missing = 0
        for g, window in enumerate(self.group_windows):
            first = self._first_visible(g, start)
            # A table's NULL_BLOCK entries are a prefix no longer than ``first``: the rest are held.
            held = max(0, min(len(tables[g]) + len(hit[g]), needed) - first)
            want = needed - first
            if window is not None and self.max_chunk_tokens:
                # A prompt longer than a chunk never holds more than the chunk's window at once.
                want = min(want, sliding_blocks_needed(window, self.block_size, self.max_chunk_tokens))
            missing += max(0, want - held)
            missing += sum(1 for b in hit[g] if b != NULL_BLOCK and self.pool.is_free(b))
            # Ours alone and out of the window: freed before anything is allocated.
            missing -= sum(1 for i in _leaving(tables[g], first) if self.pool.ref_counts[tables[g][i]] == 1)
        return missing

    def _hash_full_blocks(self, request: Request) -> None:
        hashes = request.block_hashes
        size = self.block_size
        for index in range(len(hashes), request.num_tokens // size):
            # The first block is chained on the request's salt: a tenant's blocks (and, for hybrid
            # models, the state checkpoints keyed by these hashes) are found by that tenant only.
            parent = hashes[-1] if hashes else salt_root(request.cache_salt)
            hashes.append(hash_block(parent, request.token_ids[index * size : (index + 1) * size]))


def _leaving(table: list[int], first: int) -> list[int]:
    """Indices below ``first`` that still hold a block, last first. A sliding group's freed
    entries are a prefix of its table, so this walks back only over the blocks leaving now."""
    gone = []
    i = min(first, len(table)) - 1
    while i >= 0 and table[i] != NULL_BLOCK:
        gone.append(i)
        i -= 1
    return gone

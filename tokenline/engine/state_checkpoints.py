"""Recurrent-state checkpoints: what lets a hybrid model (Gated DeltaNet + attention) reuse a prefix.

A cached KV prefix restores the attention layers but not the linear layers, whose fixed-size state
has absorbed every token. So the engine also keeps copies of a sequence's linear-layer state (conv
window + delta-rule matrix) taken at block boundaries, each keyed by the hash of the block that
ends there. A new request's KV match is cut back to the deepest matched block with a checkpoint;
the checkpoint is copied into its state slot and only the rest is prefilled.

This is the torch-free book of a separately budgeted pool of checkpoint slots (the runner holds
the tensors: slot ``i`` of this pool is row ``base + i`` of every linear layer's state tensors).

* Saves are planned while a step is scheduled and become findable only when the step ran
  (:meth:`commit`): a request admitted in the same step must not restore a state not yet written.
* Checkpoints at ``interval`` boundaries and at the end of the prompt stay until evicted (LRU).
  Besides those, each sequence keeps one *tail*: its deepest block boundary so far, replaced as it
  grows, so a finished turn leaves its state at its last block for the next turn to continue from.
* A checkpoint a step restores from is pinned until the step ran: the same step's saves never
  evict it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CheckpointStats:
    saved: int = 0  # checkpoints written
    hits: int = 0  # admissions that restored a checkpoint
    restored_tokens: int = 0  # prompt tokens those restores skipped


@dataclass
class PendingSave:
    """A save planned for the running step: after ``depth`` tokens, into ``slot``."""

    block_hash: bytes
    slot: int
    request_id: str
    depth: int
    tail: bool  # a rolling tail (dropped when the sequence saves a deeper one), not a keeper


@dataclass
class StateCheckpointPool:
    num_slots: int
    interval: int  # tokens between kept checkpoints, a multiple of the block size
    stats: CheckpointStats = field(default_factory=CheckpointStats)

    def __post_init__(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))
        # Committed checkpoints in LRU order (front = evicted first).
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: list[PendingSave] = []
        self._pinned: set[int] = set()  # slots restored from in the running step
        self._tails: dict[str, bytes] = {}  # request id -> its current tail checkpoint

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._index.get(block_hash)

    def restore(self, block_hash: bytes, num_tokens: int) -> int:
        """The slot to copy a new request's state from; pinned until the step ran."""
        slot = self._index[block_hash]
        self._index.move_to_end(block_hash)
        self._pinned.add(slot)
        self.stats.hits += 1
        self.stats.restored_tokens += num_tokens
        return slot

    def plan_save(self, block_hash: bytes, request_id: str, depth: int, tail: bool) -> int | None:
        """A slot to save into during this step, or None: already saved (it is refreshed instead),
        already planned, or every slot is pinned or pending."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            if tail and self._tails.get(request_id) != block_hash:
                self._drop_tail(request_id)
            return None
        if any(p.block_hash == block_hash for p in self._pending):
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._pending.append(PendingSave(block_hash, slot, request_id, depth, tail))
        return slot

    def commit(self) -> None:
        """The step ran: its saves become findable, its restores are done."""
        for save in sorted(self._pending, key=lambda p: p.depth):
            self._drop_tail(save.request_id)  # a deeper state of the same sequence supersedes it
            self._index[save.block_hash] = save.slot
            if save.tail:
                self._tails[save.request_id] = save.block_hash
            self.stats.saved += 1
        self._pending.clear()
        self._pinned.clear()

    def forget_request(self, request_id: str) -> None:
        """A sequence left (finished, aborted, preempted): its tail stays as an ordinary checkpoint."""
        self._tails.pop(request_id, None)

    def clear(self) -> None:
        """Forget every committed checkpoint (pending saves of the running step still land)."""
        pending = {p.slot for p in self._pending}
        for slot in self._index.values():
            if slot not in pending:
                self._free.append(slot)
        self._index.clear()
        self._tails.clear()

    def check_integrity(self) -> None:
        committed = list(self._index.values())
        pending = [p.slot for p in self._pending]
        held = committed + pending
        if len(set(held)) != len(held) or sorted(held + self._free) != list(range(self.num_slots)):
            raise AssertionError("state checkpoints: a slot is held twice or lost")
        if not set(self._tails.values()) <= set(self._index):
            raise AssertionError("state checkpoints: a tail names a checkpoint that is gone")

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._index.items():
            if slot not in self._pinned:
                del self._index[block_hash]
                for request_id, tail in list(self._tails.items()):
                    if tail == block_hash:
                        del self._tails[request_id]
                return slot
        return None

    def _drop_tail(self, request_id: str) -> None:
        block_hash = self._tails.pop(request_id, None)
        if block_hash is None:
            return
        slot = self._index.get(block_hash)
        if slot is not None and slot not in self._pinned:
            del self._index[block_hash]
            self._free.append(slot)

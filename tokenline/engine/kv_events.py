"""KV cache events in vLLM's shape: what the engine cached, evicted and cleared.

The block pool records them as they happen; the engine core drains them every step and sends them
with the step's outputs (``StepOutputs.kv_events``), and — when ``EngineConfig.kv_events_endpoint``
is set — publishes them on a ZMQ socket (``tokenline.engine.kv_events_zmq``). A prefix-aware
router or a live page replays them into a :class:`CachedBlockIndex` and knows exactly which block
hashes a replica holds, instead of guessing from the prompts it routed there.

Wire format (the same as vLLM's ``vllm/distributed/kv_events.py``, whose msgspec structs are
``array_like`` and tagged): a msgpack array ``[ts, [event, ...], data_parallel_rank]`` where each
event is an array that starts with its class name::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium
     (, lora_name, extra_keys: only when a block has extra keys)]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A salted sequence's first block (``EngineRequest.cache_salt``) carries the salt as its extra key,
``[(salt,), None, ...]``, as vLLM's events carry ``cache_salt``: its hash is chained on
``block_pool.salt_root(salt)``, so a consumer that keys blocks from their tokens needs the salt too.

Block hashes: ours are the 32-byte chained SHA-256 keys of ``block_pool.hash_block`` and travel as
msgpack ``bin``; vLLM sends ints or bytes. The decoder keeps whatever arrives, and also reads the
map form (``{"type": "BlockStored", ...}``) that newer vLLM versions send.

Torch-free on purpose: a router process imports this without a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

ExternalBlockHash = bytes | int  # ours are bytes; vLLM's may be ints


@dataclass
class BlockStored:
    """Full blocks whose KV is now findable by hash. ``block_hashes`` run in prefix order; the
    first one's parent is ``parent_block_hash`` (None for a sequence's first block) and each later
    one's parent is the hash before it. ``token_ids`` are the blocks' tokens, concatenated."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # None: the engine's one KV cache (we have no CPU/disk tiers)
    lora_name: str | None = None
    # Per block, what else its hash covers (vLLM: the cache salt on a sequence's first block,
    # multimodal ids, a LoRA name); None: nothing, for every block.
    extra_keys: list[tuple[Any, ...] | None] | None = None

    def first_block_salt(self) -> tuple[bool, str | None]:
        """(whether the run can be keyed from tokens and a salt alone, the first block's cache salt):
        False when a block's hash covers more than a salt (multimodal ids, a LoRA)."""
        extras = self.extra_keys or []
        if any(e for e in extras[1:]):
            return False, None
        first = extras[0] if extras else None
        if not first:
            return True, None
        if len(first) == 1 and isinstance(first[0], str) and self.parent_block_hash is None:
            return True, first[0]
        return False, None


@dataclass
class BlockRemoved:
    """Blocks no longer findable: evicted to make room, so a router must stop counting on them."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    """The events of one engine step. ``ts`` is wall-clock seconds (``time.time()``), as in vLLM,
    so that consumers on other machines can order batches from several replicas."""

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


class KVEventRecorder:
    """An append-only list of events that merges a run of blocks into one event, as vLLM does:
    a stored block whose parent is the last block of the previous ``BlockStored`` extends it, and
    consecutive removals share one ``BlockRemoved``. Merging never reorders events."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def stored(
        self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int], salt: str | None = None
    ) -> None:
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and parent_hash is not None
            and last.block_hashes[-1] == parent_hash
            and last.block_size == len(token_ids)
        ):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            if last.extra_keys is not None:
                last.extra_keys.append(None)
        else:
            extra_keys: list[tuple[Any, ...] | None] | None = [(salt,)] if salt is not None else None
            self._events.append(BlockStored([block_hash], parent_hash, list(token_ids), len(token_ids),
                                            extra_keys=extra_keys))

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        # Everything recorded before a clear is moot for a consumer that applies the clear.
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


class CachedBlockIndex:
    """The set of block hashes an engine holds, rebuilt from its events (what a router keeps per
    replica). ``parents`` maps each held hash to its parent, so a prompt's chain can be walked."""

    def __init__(self) -> None:
        self.parents: dict[ExternalBlockHash, ExternalBlockHash | None] = {}

    @property
    def hashes(self) -> set[ExternalBlockHash]:
        return set(self.parents)

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for block_hash in event.block_hashes:
                    self.parents[block_hash] = parent
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.parents.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self.parents.clear()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.parents

    def __len__(self) -> int:
        return len(self.parents)


# --- msgpack codec -----------------------------------------------------------------------------


def _event_to_wire(event: KVCacheEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        fields = ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                  event.block_size, event.lora_id, event.medium]
        if event.extra_keys is not None:  # msgspec's omit_defaults drops trailing defaults
            fields += [event.lora_name, event.extra_keys]
        return fields
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_event_batch(batch: EventBatch) -> bytes:
    """msgpack bytes of a batch, laid out as vLLM's array_like structs (bytes as ``bin``)."""
    fields: list[Any] = [batch.ts, [_event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:  # msgspec's omit_defaults drops a None rank
        fields.append(batch.data_parallel_rank)
    return msgpack.packb(fields, use_bin_type=True)


def _pick(raw: Sequence[Any], index: int) -> Any:
    return raw[index] if index < len(raw) else None


def _event_from_wire(raw: Any) -> KVCacheEvent:
    if isinstance(raw, dict):  # newer vLLM: a map tagged by "type"
        kind = raw.get("type")
        if kind == "BlockStored":
            return BlockStored(list(raw["block_hashes"]), raw.get("parent_block_hash"), list(raw["token_ids"]),
                               raw["block_size"], raw.get("lora_id"), raw.get("medium"), raw.get("lora_name"),
                               _extra_keys(raw.get("extra_keys")))
        if kind == "BlockRemoved":
            return BlockRemoved(list(raw["block_hashes"]), raw.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        raise ValueError(f"unknown KV cache event type {kind!r}")
    kind = raw[0]
    # Fields past the ones we know (vLLM's group_idx, ...) are ignored.
    if kind == "BlockStored":
        return BlockStored(list(raw[1]), raw[2], list(raw[3]), raw[4], _pick(raw, 5), _pick(raw, 6), _pick(raw, 7),
                           _extra_keys(_pick(raw, 8)))
    if kind == "BlockRemoved":
        return BlockRemoved(list(raw[1]), _pick(raw, 2))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV cache event type {kind!r}")


def _extra_keys(raw: Any) -> list[tuple[Any, ...] | None] | None:
    # msgpack has no tuples: each block's keys arrive as a list.
    return None if raw is None else [None if keys is None else tuple(keys) for keys in raw]


def decode_event_batch(payload: bytes) -> EventBatch:
    """Read one batch published by tokenline or by vLLM."""
    raw = msgpack.unpackb(payload, raw=False)
    if isinstance(raw, dict):
        return EventBatch(raw["ts"], [_event_from_wire(e) for e in raw["events"]], raw.get("data_parallel_rank"))
    return EventBatch(raw[0], [_event_from_wire(e) for e in raw[1]], _pick(raw, 2))

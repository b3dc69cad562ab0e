"""The routing policies: round robin, least load, approximate and precise prefix affinity, sessions.

Pure Python over the records of :mod:`tokenline.router.policy`, so the same objects route for
N local engines, a remote router, Ray Serve and the simulator. ``make_policy`` builds one by name.

Load, wherever a policy weighs it, is ``num_running + num_waiting + in_flight`` (``in_flight`` is
this router's own count, fresher than the replica's last report, so a burst spreads out before the
replicas report it). Prefix keys are the engine's own block keys (``block_pool.hash_block``: a
SHA-256 chained over full blocks of ``block_size`` tokens, the first chained on the request's cache
salt, ``block_pool.salt_root``), so a key equal here means the engine can reuse that whole prefix
for this request: one tenant's cached prompt never attracts another tenant's requests.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from tokenline.engine.block_pool import hash_block, salt_root
from tokenline.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVCacheEvent
from tokenline.router.policy import ReplicaState, RouteDecision, RouteRequest, RoutingPolicy

TEXT_BLOCK_CHARS = 64  # the approximate tree's block when a request carries text, not tokens
_PENDING_CAP = 4096  # chains kept between choose and on_routed; more means on_routed is not called


def load(replica: ReplicaState) -> int:
    """Requests on a replica as this router sees them."""
    return replica.num_running + replica.num_waiting + replica.in_flight


def block_chain(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The engine's keys of a prompt's full blocks, in prefix order: ``hash_block`` chained from
    ``salt_root(salt)``, with the prompt packed once instead of once per block (most of a
    decision's cost is here)."""
    packed = memoryview(array("q", token_ids)).cast("B")
    step = block_size * 8  # bytes per block of int64 ("q") tokens
    chain: list[bytes] = []
    parent = salt_root(salt) or b""
    for start in range(0, len(token_ids) // block_size * step, step):
        digest = hashlib.sha256(parent)
        digest.update(packed[start : start + step])
        parent = digest.digest()
        chain.append(parent)
    return chain


def text_chain(text: str, chars: int = TEXT_BLOCK_CHARS) -> list[bytes]:
    """Chained keys of a text's full ``chars``-character blocks (a router that did not tokenize).
    Salted, so they never equal a token block's key."""
    chain: list[bytes] = []
    parent = b"text"
    for start in range(0, len(text) - chars + 1, chars):
        parent = hashlib.sha256(parent + text[start : start + chars].encode("utf-8", "surrogatepass")).digest()
        chain.append(parent)
    return chain


def _least_loaded(replicas: Iterable[ReplicaState]) -> ReplicaState:
    return min(replicas, key=lambda r: (load(r), r.name))


class RoundRobin(RoutingPolicy):
    """Each request to the next replica in name order after the last one chosen, so the turn
    survives replicas joining and leaving (an index into a changing list would skip or repeat)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RouteDecision:
        names = sorted(r.name for r in replicas)
        after = [n for n in names if self._last is not None and n > self._last]
        chosen = after[0] if after else names[0]
        self._last = chosen
        return RouteDecision(chosen, "round_robin")


class LeastLoad(RoutingPolicy):
    """Power of two choices: two distinct replicas at random, the lighter one wins.

    ``score = num_running + num_waiting + in_flight + kv_weight × kv_cache_usage``: a replica whose
    KV cache is full will queue or preempt, so a full cache weighs like ``kv_weight`` requests.
    Ties go to the name first in order. Sampling two instead of scanning all avoids the herd where
    every router sends the next burst to the same momentarily emptiest replica.
    """

    name = "least_load"

    def __init__(self, *, seed: int | None = None, kv_weight: float = 8.0) -> None:
        self.kv_weight = kv_weight
        self._random = random.Random(seed)

    def score(self, replica: ReplicaState) -> float:
        return load(replica) + self.kv_weight * replica.kv_cache_usage

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RouteDecision:
        pair = self._random.sample(list(replicas), 2) if len(replicas) > 2 else list(replicas)
        best = min(pair, key=lambda r: (self.score(r), r.name))
        return RouteDecision(best.name, "least_load")


class _PrefixMemo:
    """Chains computed in ``choose``, kept for the ``on_routed`` that follows (hashing a 2k-token
    prompt is most of a decision's cost; doing it twice would double it)."""

    def __init__(self, text_block_chars: int) -> None:
        self.text_block_chars = text_block_chars
        self._pending: OrderedDict[str, dict[int, list[bytes]]] = OrderedDict()

    def chain(self, request: RouteRequest, block_size: int) -> tuple[list[bytes], int]:
        """The request's keys at ``block_size`` and the tokens one key stands for (0 for text,
        whose token count is unknown)."""
        per_size = self._pending.get(request.request_id)
        if per_size is None:
            per_size = self._pending[request.request_id] = {}
            while len(self._pending) > _PENDING_CAP:
                self._pending.popitem(last=False)
        if request.token_ids is not None:
            if block_size not in per_size:
                per_size[block_size] = block_chain(request.token_ids, block_size, request.cache_salt)
            return per_size[block_size], block_size
        if request.text is not None:
            if 0 not in per_size:
                per_size[0] = text_chain(request.text, self.text_block_chars)
            return per_size[0], 0
        return [], 0

    def done(self, request_id: str) -> None:
        self._pending.pop(request_id, None)


class _Holders:
    """Which replicas hold each key: a bit mask per key (one bit per replica). Ints, not sets,
    because 100k long-lived sets made each of Python's full garbage collections take tens of ms
    (a p99 spike); ints are not tracked by the collector, and masks intersect in one operation."""

    def __init__(self) -> None:
        self.masks: dict[bytes, int] = {}
        self._bits: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0

    def bit(self, name: str) -> int:
        bit = self._bits.get(name)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                bit, self._next = 1 << self._next, self._next + 1
            self._bits[name] = bit
        return bit

    def add(self, key: bytes, name: str) -> None:
        self.masks[key] = self.masks.get(key, 0) | self.bit(name)

    def discard(self, key: bytes, name: str) -> None:
        mask = self.masks.get(key, 0) & ~self.bit(name)
        if mask:
            self.masks[key] = mask
        else:
            self.masks.pop(key, None)

    def release(self, name: str) -> None:
        """``name`` holds nothing any more (the caller discarded its keys): reuse its bit."""
        bit = self._bits.pop(name, None)
        if bit is not None:
            self._free.append(bit)

    def match(self, chain: Sequence[bytes], names: Iterable[str]) -> dict[str, int]:
        """How many leading keys of ``chain`` each of ``names`` holds: one walk down the chain,
        narrowing the mask of replicas that still match (as Dynamo's indexer does)."""
        bits = {name: self.bit(name) for name in names}
        active = 0
        for bit in bits.values():
            active |= bit
        stops: list[tuple[int, int]] = []  # (replicas whose match ends here, depth)
        for depth, key in enumerate(chain):
            still = active & self.masks.get(key, 0)
            if still != active:
                stops.append((active & ~still, depth))
                active = still
                if not active:
                    break
        stops.append((active, len(chain)))
        return {name: next(depth for mask, depth in stops if mask & bit) for name, bit in bits.items()}


class ApproximatePrefix(RoutingPolicy):
    """SGLang's cache-aware router without events: the router remembers which block keys it sent
    to each replica and assumes they are still cached there.

    Per replica an LRU of keys capped at ``max_blocks_per_replica``, or at the replica's KV cache
    size when it reports one (``ReplicaState.num_kv_blocks``) and that is smaller: the tree never
    believes a replica holds more than fits there, so a prefix it must have evicted stops
    attracting requests and is placed again like a new one (on the smaller, then less loaded tree)
    instead of pinning its group to a replica that recomputes it every time. A request's keys are
    touched deepest first, so a block is always more recent than its descendants and eviction
    removes leaves before their parents: what remains is still a set of whole prefixes (a tree).

    Decision, in SGLang's order: (1) imbalance — max load − min load > ``balance_abs_threshold``
    and max load > ``balance_rel_threshold`` × min load: the least loaded replica; (2) the longest
    cached prefix, if matched / prompt blocks > ``cache_threshold``; (3) else the replica with the
    smallest tree. Ties go to the lower load, then the name first in order.
    """

    name = "prefix"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_blocks_per_replica: int = 2**16,
        text_block_chars: int = TEXT_BLOCK_CHARS,
    ) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be at least 1, got {max_blocks_per_replica}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_blocks_per_replica = max_blocks_per_replica
        self._trees: dict[str, OrderedDict[bytes, None]] = {}
        self._holders = _Holders()
        self._block_size: dict[str, int] = {}
        self._capacity: dict[str, int] = {}  # replica -> the blocks its tree may hold
        self._memo = _PrefixMemo(text_block_chars)

    def tree_size(self, replica: str) -> int:
        return len(self._trees.get(replica, ()))

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RouteDecision:
        for replica in replicas:
            self._block_size[replica.name] = replica.block_size
            self._capacity[replica.name] = min(self.max_blocks_per_replica,
                                               replica.num_kv_blocks or self.max_blocks_per_replica)
        matched: dict[str, int] = {}
        tokens_per_block: dict[str, int] = {}
        for size in {r.block_size for r in replicas}:
            chain, tokens = self._memo.chain(request, size)
            names = {r.name for r in replicas if r.block_size == size}
            matched.update(self._holders.match(chain, names))
            tokens_per_block.update(dict.fromkeys(names, tokens))

        def decision(replica: ReplicaState, reason: str) -> RouteDecision:
            return RouteDecision(replica.name, reason, matched[replica.name] * tokens_per_block[replica.name])

        loads = [load(r) for r in replicas]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return decision(_least_loaded(replicas), "imbalance")
        best = min(replicas, key=lambda r: (-matched[r.name], load(r), r.name))
        chain_len = len(self._memo.chain(request, best.block_size)[0])
        if chain_len and matched[best.name] / chain_len > self.cache_threshold:
            return decision(best, "prefix")
        smallest = min(replicas, key=lambda r: (self.tree_size(r.name), load(r), r.name))
        return decision(smallest, "smallest_tree")

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        name = decision.replica
        chain, _ = self._memo.chain(request, self._block_size.get(name, 16))
        self._memo.done(request.request_id)
        tree = self._trees.setdefault(name, OrderedDict())
        for key in reversed(chain):  # deepest first: a parent ends up more recent than its children
            if key in tree:
                tree.move_to_end(key)
            else:
                tree[key] = None
                self._holders.add(key, name)
        while len(tree) > self._capacity.get(name, self.max_blocks_per_replica):
            key, _ = tree.popitem(last=False)
            self._holders.discard(key, name)

    def on_kv_events(self, replica: str, events: Sequence[KVCacheEvent]) -> None:
        # No events are needed, but a replica that reports it dropped everything (a reset, a
        # restart) holds nothing we routed there before.
        if any(isinstance(e, AllBlocksCleared) for e in events):
            self.remove_replica(replica)

    def remove_replica(self, replica: str) -> None:
        for key in self._trees.pop(replica, {}):
            self._holders.discard(key, replica)
        self._holders.release(replica)
        self._block_size.pop(replica, None)
        self._capacity.pop(replica, None)


class _ReplicaBlocks:
    """What one replica holds, in our keys: its hash of each block → our key (the translation
    that lets removals and children be mapped), and how many of its hashes stand for each key."""

    def __init__(self) -> None:
        self.ours: dict[ExternalBlockHash, bytes] = {}
        self.count: dict[bytes, int] = {}
        self.block_size: int | None = None


class PreciseKV(RoutingPolicy):
    """Prefix affinity from the replicas' own KV events (llm-d / Dynamo style): exact, evictions
    included.

    Events may carry our hashes or vLLM's (ints, or bytes made another way), so every stored block
    is translated to our key from its tokens: ``ours = hash_block(ours of its parent, tokens)``, a
    sequence's first block chained on the salt its event names (``extra_keys``, as vLLM sends
    ``cache_salt``). A block whose parent this policy never saw (events before it subscribed) cannot
    be chained and is skipped, as are blocks with a LoRA adapter, other extra keys (multimodal) or
    outside the GPU cache (``medium`` other than None/"GPU"): a plain prompt can never hit them there.

    ``cost = overlap_weight × (prompt tokens not cached there) + load × typical``, lowest wins, in
    tokens so that replicas with different block sizes compare; ties go to the longer hit (less
    work either way), then the lower load, then the fewest cached tokens (so new prefixes spread
    over idle replicas instead of piling on the first name). ``typical`` is what one queued request
    costs: ``typical_blocks`` of the replica's block size, default this prompt's tokens, so with
    weight 1 a full prefix hit is worth about one request of queue. Reasons: "prefix" (a hit where it went), "least_load" (a hit elsewhere
    lost to load), "no_prefix" (no replica holds any of the prompt).
    """

    name = "kv_events"

    def __init__(self, *, overlap_weight: float = 1.0, typical_blocks: int | None = None) -> None:
        self.overlap_weight = overlap_weight
        self.typical_blocks = typical_blocks
        self._replicas: dict[str, _ReplicaBlocks] = {}
        self._holders = _Holders()
        self._memo = _PrefixMemo(TEXT_BLOCK_CHARS)

    def cached_blocks(self, replica: str) -> int:
        held = self._replicas.get(replica)
        return len(held.count) if held is not None else 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RouteDecision:
        matched: dict[str, int] = {}
        prompt_blocks: dict[str, int] = {}
        sizes = {r.name: self._size(r) for r in replicas}
        for size in set(sizes.values()):
            chain = self._memo.chain(request, size)[0] if request.token_ids is not None else []
            names = {name for name, s in sizes.items() if s == size}
            matched.update(self._holders.match(chain, names))
            prompt_blocks.update(dict.fromkeys(names, len(chain)))
        self._memo.done(request.request_id)

        # In tokens, not blocks: replicas may cache in blocks of different sizes (vLLM-CPU 128,
        # tokenline 16), and a prompt's block count at 128 is 8x smaller for the same work.
        prompt_tokens = len(request.token_ids) if request.token_ids is not None else 0

        def cost(r: ReplicaState) -> float:
            size = sizes[r.name]
            typical = self.typical_blocks * size if self.typical_blocks is not None else max(1, prompt_tokens)
            return self.overlap_weight * (prompt_tokens - matched[r.name] * size) + load(r) * typical

        best = min(replicas, key=lambda r: (cost(r), -matched[r.name] * sizes[r.name], load(r),
                                            self.cached_blocks(r.name) * sizes[r.name], r.name))
        hit = matched[best.name]
        if hit:
            reason = "prefix"
        elif any(matched.values()):
            reason = "least_load"
        else:
            reason = "no_prefix"
        return RouteDecision(best.name, reason, hit * sizes[best.name])

    def _size(self, replica: ReplicaState) -> int:
        held = self._replicas.get(replica.name)
        # The size the replica's events were hashed at, once seen; its advertised size until then.
        return held.block_size if held is not None and held.block_size else replica.block_size

    def on_kv_events(self, replica: str, events: Sequence[KVCacheEvent]) -> None:
        held = self._replicas.setdefault(replica, _ReplicaBlocks())
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(replica, held, event)
            elif isinstance(event, BlockRemoved):
                if event.medium not in (None, "GPU"):
                    continue
                for external in event.block_hashes:
                    key = held.ours.pop(external, None)
                    if key is not None:
                        self._release(replica, held, key)
            elif isinstance(event, AllBlocksCleared):
                self.remove_replica(replica)
                held = self._replicas.setdefault(replica, _ReplicaBlocks())

    def _stored(self, replica: str, held: _ReplicaBlocks, event: BlockStored) -> None:
        size = event.block_size
        if event.lora_id is not None or event.medium not in (None, "GPU") or size < 1:
            return
        if len(event.token_ids) != size * len(event.block_hashes):
            return  # not full blocks of one size: nothing we could key
        keyable, salt = event.first_block_salt()
        if not keyable:
            return
        parent = salt_root(salt)
        if event.parent_block_hash is not None:
            parent = held.ours.get(event.parent_block_hash)
            if parent is None:
                return  # the chain starts at a block we never saw: its keys are unknowable
        held.block_size = size
        for index, external in enumerate(event.block_hashes):
            key = hash_block(parent, event.token_ids[index * size : (index + 1) * size])
            previous = held.ours.get(external)
            if previous != key:
                if previous is not None:
                    self._release(replica, held, previous)
                held.ours[external] = key
                held.count[key] = held.count.get(key, 0) + 1
                self._holders.add(key, replica)
            parent = key

    def _release(self, replica: str, held: _ReplicaBlocks, key: bytes) -> None:
        left = held.count[key] - 1
        if left:
            held.count[key] = left
            return
        del held.count[key]
        self._holders.discard(key, replica)

    def remove_replica(self, replica: str) -> None:
        held = self._replicas.pop(replica, None)
        if held is not None:
            for key in held.count:
                self._holders.discard(key, replica)
        self._holders.release(replica)


class SessionAffinity(RoutingPolicy):
    """A request with a ``session`` goes where its session went last (its conversation's KV is
    there), unless that replica is gone: then ``inner`` decides and the session moves. Sessions
    are kept in an LRU of ``max_sessions``; everything else is ``inner``'s."""

    def __init__(self, inner: RoutingPolicy, *, max_sessions: int = 100_000) -> None:
        self.inner = inner
        self.name = f"{inner.name}+session"
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RouteDecision:
        if request.session is not None:
            replica = self._sessions.get(request.session)
            if replica is not None and any(r.name == replica for r in replicas):
                return RouteDecision(replica, "session")
        return self.inner.choose(request, replicas)

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        if request.session is not None:
            self._sessions[request.session] = decision.replica
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self.inner.on_routed(request, decision)

    def on_finished(self, request_id: str, replica: str) -> None:
        self.inner.on_finished(request_id, replica)

    def on_kv_events(self, replica: str, events: Sequence[KVCacheEvent]) -> None:
        self.inner.on_kv_events(replica, events)

    def remove_replica(self, replica: str) -> None:
        self.inner.remove_replica(replica)


_POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "prefix": ApproximatePrefix,
    "kv_events": PreciseKV,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, *, seed: int | None = None, **options: Any) -> RoutingPolicy:
    """A policy by name; ``seed`` makes random choices repeatable; ``options`` go to its
    constructor. ``ValueError`` (one line) for an unknown name or option."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}")
    if cls is LeastLoad:
        options["seed"] = seed
    try:
        return cls(**options)
    except TypeError as error:
        raise ValueError(f"bad option for routing policy {name!r}: {error}") from None

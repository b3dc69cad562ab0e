"""The routing contract: what a policy sees of a request and of each replica, and what it answers.

One library of policies (``tokenline.router.policies``) serves every fleet shape — N local engines
(``--data-parallel-size``), remote servers (``tokenline router``) and Ray Serve replicas — so they
are pure Python over these records and never touch a transport. A policy learns from three
sources: the requests it routed (``on_routed``/``on_finished``, enough for approximate prefix
affinity), the replicas' KV events (``on_kv_events``, which also show evictions), and the load
snapshot passed to every ``choose``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from tokenline.engine.kv_events import KVCacheEvent


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the router sees it at decision time. ``in_flight`` counts the requests this
    router has sent there and not yet seen finish (fresher than the replica's own reports).
    ``num_kv_blocks`` is the size of its KV cache in blocks (engine stats, ``/metrics``), 0 when
    not known: more than that can never be cached there at once."""

    name: str
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    in_flight: int = 0
    block_size: int = 16  # KV block size of the replica, for prefix hashing
    num_kv_blocks: int = 0


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at. ``token_ids`` is the exact prompt the engine will see, when the
    router tokenized it (tokenline and vLLM upstreams); ``text`` is a fallback key for affinity
    when it did not; ``session`` is the caller's session key (``user`` or a header), if any;
    ``cache_salt`` is the salt the engine folds into the prompt's first block
    (``EngineRequest.cache_salt``), so prefix keys here are the engine's keys."""

    request_id: str
    token_ids: Sequence[int] | None = None
    text: str | None = None
    session: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class RouteDecision:
    """The chosen replica and why. ``reason`` is one of :data:`REASONS` (a metrics label);
    ``predicted_hit_tokens`` is how many prompt tokens the policy expects the replica to have cached."""

    replica: str
    reason: str
    predicted_hit_tokens: int = 0


REASONS = ("only_replica", "round_robin", "least_load", "imbalance", "prefix", "no_prefix", "smallest_tree",
           "session", "retry")


class RoutingPolicy(abc.ABC):
    """Chooses a replica for each request. Not thread-safe: one event loop owns a policy."""

    name: str = "policy"

    @abc.abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RouteDecision:
        """Pick one of ``replicas`` (never empty; all healthy) for ``request``."""

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:  # noqa: B027
        """The request was sent to ``decision.replica`` (an approximate tree learns its prefix)."""

    def on_finished(self, request_id: str, replica: str) -> None:  # noqa: B027
        """The request ended on ``replica``."""

    def on_kv_events(self, replica: str, events: Sequence[KVCacheEvent]) -> None:  # noqa: B027
        """The replica cached, evicted or cleared blocks (vLLM's events, ours or vLLM's hashes)."""

    def remove_replica(self, replica: str) -> None:  # noqa: B027
        """The replica left the fleet (dead, ejected or scaled down): forget what it held."""

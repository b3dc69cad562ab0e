"""``tokenline serve --ray``: engine replicas on Ray Serve, routed by tokenline's policies.

What runs where:

- **The API process** (this one) stays the normal tokenline server: uvicorn, the door, the
  gateway (keys, limits, ledger in local SQLite, metrics, live page) and the request processor.
  Its engine is a ``RayEngineClient``, which drives a Ray Serve ``DeploymentHandle``. Keeping the
  ingress out of Ray keeps every HTTP behaviour, the ledger and SIGTERM handling exactly as with a
  local engine; Ray Serve's HTTP proxy is not started.
- **Each replica** (``EngineReplica``, a Ray Serve deployment) runs one tokenline engine: an
  ``EngineProcessClient`` and its engine process, so torch and the step loop never share the
  replica actor's event loop. It exposes ``generate`` (a streaming call: the replica's id, then
  merged outputs with the replica's stats), ``abort`` and ``model_info``, and reports its load and
  cached KV blocks through Ray Serve's ``record_routing_stats``.
- **Routing** happens in the handle's router, in this process: ``TokenlineRequestRouter`` (a Ray
  Serve ``RequestRouter``) builds a ``ReplicaState`` per replica from its routing stats and the
  requests it has in flight there, asks the tokenline ``RoutingPolicy`` and returns ranked tiers:
  the policy's choice first, the rest by load (Ray Serve falls through when a replica is full).
  An ``abort`` call names its replica and is routed there.

A replica's cached blocks reach the policy as KV events: each routing-stats snapshot is diffed
against the last one seen (``BlockRemoved`` for what left, ``BlockStored`` for what came), since
Ray Serve broadcasts snapshots and may skip some.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Before ray is imported: its C++ handler caught the server's SIGTERM and aborted the process
# during the graceful shutdown (exit 134, agents orphaned); uvicorn's handler is the one we want.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a server never phones home

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica  # noqa: E402

from tokenline.engine.client import EngineClient, EngineDeadError, EngineRequestError, OutputCollector
from tokenline.engine.config import EngineConfig
from tokenline.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from tokenline.engine.messages import EngineOutput, EngineReady, EngineRequest, EngineStats, StepOutputs
from tokenline.router.fleet import sum_stats
from tokenline.router.policy import ReplicaState, RouteDecision, RouteRequest, RoutingPolicy

logger = logging.getLogger("tokenline.router")

DEFAULT_RAY_POLICY = "prefix"  # affinity from the prompts routed: needs no snapshot to be fresh
MAX_REPORTED_BLOCKS = 8192  # cached blocks a replica reports per snapshot (the newest)


@dataclass
class RayServeSettings:
    """``serve --ray``'s flags. ``num_replicas`` is fixed unless ``max_replicas`` is set, then Ray
    Serve autoscales between ``min_replicas`` and ``max_replicas`` on ``target_ongoing_requests``.
    ``address``: an existing cluster (``auto``, ``ray://…``); None starts a local one."""

    num_replicas: int = 1
    address: str | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    routing_policy: str = DEFAULT_RAY_POLICY
    session_affinity: bool = False
    threads_per_engine: int | None = None
    app_name: str = "tokenline"
    routing_stats_period_s: float = 1.0
    max_ongoing_requests: int = 256  # the engine queues itself; Ray Serve's cap only guards memory

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be at least 1, got {self.num_replicas}")
        if self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            if low < 0 or self.max_replicas < max(1, low):
                raise ValueError(f"--min-replicas {low} and --max-replicas {self.max_replicas}: "
                                 "need 0 <= min <= max and max >= 1")
        elif self.min_replicas is not None or self.target_ongoing_requests is not None:
            raise ValueError("--min-replicas and --target-ongoing-requests need --max-replicas (autoscaling)")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ValueError(f"--target-ongoing-requests must be positive, got {self.target_ongoing_requests}")

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.num_replicas

    def autoscaling_config(self) -> dict[str, Any] | None:
        if self.max_replicas is None:
            return None
        config: dict[str, Any] = {
            "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
            "max_replicas": self.max_replicas,
            "initial_replicas": min(max(self.num_replicas, self.min_replicas or 1), self.max_replicas),
        }
        if self.target_ongoing_requests is not None:
            config["target_ongoing_requests"] = self.target_ongoing_requests
        return config


# --- the replica ---------------------------------------------------------------------------------


@dataclass
class ReplicaChunk:
    """One item of a replica's ``generate`` stream after its id: outputs merged since the last
    item, and the replica's load at that moment."""

    outputs: list[EngineOutput]
    stats: EngineStats


@dataclass
class ReplicaRefusal:
    """The engine refused the request (a 4xx-class ``EngineRequestError``), as the last item."""

    param: str
    message: str


class EngineReplica:
    """One Ray Serve replica: a tokenline engine process behind an ``EngineProcessClient``."""

    async def __init__(self, config: EngineConfig, model_dir: str, vocab_size: int | None) -> None:
        from ray import serve

        from tokenline.engine.client import RestartPolicy
        from tokenline.engine.process_client import EngineProcessClient

        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        # Blocks this engine holds, in the order they were stored: hash -> (parent, tokens, the cache
        # salt of a sequence's first block).
        self.blocks: dict[Any, tuple[Any, list[int], str | None]] = {}
        self.client = EngineProcessClient(config, Path(model_dir), vocab_size, RestartPolicy())
        self.client.add_step_listener(self._on_step)
        self.client.start()
        self.info = await self.client.wait_ready()
        logger.warning("replica %s: engine pid %s ready", self.name, self.client.pid)

    def _on_step(self, step: StepOutputs) -> None:
        for event in step.kv_events:
            if isinstance(event, BlockStored):
                parent, size = event.parent_block_hash, event.block_size
                salt = event.first_block_salt()[1]
                for index, block_hash in enumerate(event.block_hashes):
                    self.blocks.pop(block_hash, None)  # re-stored: newest again
                    tokens = event.token_ids[index * size:(index + 1) * size]
                    self.blocks[block_hash] = (parent, tokens, salt if index == 0 else None)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.blocks.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()

    async def generate(self, requests: list[EngineRequest], avoid: str | None = None) -> AsyncIterator[object]:
        """``avoid`` is for the router: a retry names the replica that failed the first attempt."""
        yield self.name  # first: where the request runs (the caller routes its abort here)
        collector = self.client.add(requests)
        try:
            while not collector.finished:
                try:
                    outputs = await collector.get()
                except EngineRequestError as error:
                    yield ReplicaRefusal(error.param, str(error))
                    return
                yield ReplicaChunk(outputs, self.client.stats)
        finally:
            if not collector.finished:  # the caller went away (cancelled stream): free the engine
                self.client.abort(collector.request_ids)
            self.client.forget(collector)

    def abort(self, replica: str, request_ids: list[str]) -> None:
        """``replica`` is for the router (it sends the call there); the engine answers in the stream."""
        self.client.abort(request_ids)

    def model_info(self) -> EngineReady:
        return self.info

    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.client.stats
        blocks = list(self.blocks.items())[-MAX_REPORTED_BLOCKS:]
        return {
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage, "block_size": self.info.block_size,
            "num_kv_blocks": stats.num_kv_blocks,
            "blocks": [(h, parent, tokens, salt) for h, (parent, tokens, salt) in blocks],
        }

    def check_health(self) -> None:
        if self.client.gave_up or (self.client.error is not None and not self.client.restarting):
            raise RuntimeError(f"engine of replica {self.name} is dead: {self.client.error}")

    async def __del__(self) -> None:
        await self.client.shutdown()


# --- the router ----------------------------------------------------------------------------------


def resolve_policy(name: str, session_affinity: bool = False, seed: int | None = None) -> RoutingPolicy:
    """A policy by name (tokenline/router/policies.py), or ``module:factory`` for one of your own."""
    if ":" in name:
        import importlib

        module, _, attribute = name.partition(":")
        policy = getattr(importlib.import_module(module), attribute)()
        if session_affinity:
            from tokenline.router.policies import SessionAffinity

            policy = SessionAffinity(policy)
        return policy
    from tokenline.router.data_parallel import build_policy

    return build_policy(name, session_affinity, seed)


def snapshot_events(previous: dict[Any, tuple[Any, ...]], blocks: Sequence[tuple[Any, ...]],
                    block_size: int) -> tuple[list[KVCacheEvent], dict[Any, tuple[Any, ...]]]:
    """The KV events that turn the blocks a replica reported last time into what it reports now.
    A block is ``(hash, parent, tokens[, cache salt of a sequence's first block])``."""
    current = {h: tuple(rest) for h, *rest in blocks}
    events: list[KVCacheEvent] = []
    removed = [h for h in previous if h not in current]
    if removed:
        events.append(BlockRemoved(removed))
    for block_hash, (parent, tokens, *salt) in current.items():
        if block_hash not in previous:
            extra_keys = [(salt[0],)] if salt and salt[0] is not None else None
            events.append(BlockStored([block_hash], parent, list(tokens), block_size, extra_keys=extra_keys))
    return events, current


class TokenlineRequestRouter(RequestRouter):
    """Ray Serve's routing hook, answered by a tokenline ``RoutingPolicy`` (built in
    ``initialize_state`` from ``request_router_kwargs``: ``policy``, ``session_affinity``, ``seed``)."""

    def initialize_state(self, policy: str = DEFAULT_RAY_POLICY, session_affinity: bool = False,
                         seed: int | None = None, **_: Any) -> None:
        self.policy = resolve_policy(policy, session_affinity, seed)
        self.in_flight: Counter[str] = Counter()
        self.routes: dict[str, RouteRequest] = {}  # internal request id -> what the policy saw
        self.chosen: dict[str, RouteDecision] = {}  # internal request id -> the policy's latest answer
        self.decisions: Counter[tuple[str, str]] = Counter()  # (replica, reason) -> requests
        self._blocks: dict[str, dict[Any, tuple[Any, list[int]]]] = {}
        self._stats_seen: dict[str, dict[str, Any]] = {}  # the snapshot last applied (kept: no id reuse)

    def replica_state(self, replica: RunningReplica) -> ReplicaState:
        name = replica.replica_id.to_full_id_str()
        stats = replica.routing_stats or {}
        self._feed_blocks(name, stats)
        return ReplicaState(
            name=name, num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
            kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)), in_flight=self.in_flight[name],
            block_size=int(stats.get("block_size", 16)), num_kv_blocks=int(stats.get("num_kv_blocks", 0)),
        )

    def _feed_blocks(self, name: str, stats: dict[str, Any]) -> None:
        if "blocks" not in stats or self._stats_seen.get(name) is stats:
            return  # no report yet, or this snapshot was applied already
        self._stats_seen[name] = stats
        events, self._blocks[name] = snapshot_events(self._blocks.get(name, {}), stats["blocks"],
                                                     int(stats.get("block_size", 16)))
        if events:
            try:
                self.policy.on_kv_events(name, events)
            except Exception:  # noqa: BLE001 - a policy bug must not stop routing
                logger.exception("routing policy failed on KV events from %s", name)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        if pending_request is not None and pending_request.metadata.call_method == "abort":
            target = by_name.get(str(pending_request.args[0])) if pending_request.args else None
            # A gone replica took its requests with it: any replica answers the no-op.
            return [[target]] if target is not None else [candidate_replicas[:1]]
        avoid = pending_request.args[1] if pending_request is not None and len(pending_request.args) > 1 else None
        if avoid is not None and len(by_name) > 1 and avoid in by_name:  # a retry: anywhere but there
            candidate_replicas = [r for r in candidate_replicas if r.replica_id.to_full_id_str() != avoid]
            by_name.pop(avoid)
        states = [self.replica_state(r) for r in candidate_replicas]
        route = _route_request(pending_request)
        if route is None:  # model_info and other calls: least loaded first
            return [[by_name[s.name] for s in sorted(states, key=_load)]]
        if len(states) == 1:
            decision = RouteDecision(states[0].name, "only_replica")
        else:
            decision = self.policy.choose(route, states)
        self.routes[route.request_id] = route
        self.chosen[route.request_id] = decision
        rest = sorted((s for s in states if s.name != decision.replica), key=_load)
        return [[by_name[decision.replica]], [by_name[s.name] for s in rest]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        route = self.routes.get(pending_request.metadata.internal_request_id)
        if route is None:
            return
        name = replica_id.to_full_id_str()
        chosen = self.chosen.pop(route.request_id, None)
        if chosen is None or chosen.replica != name:  # the policy's choice was full: a fallback tier took it
            chosen = RouteDecision(name, "least_load")
        self.in_flight[name] += 1
        self.decisions[(name, chosen.reason)] += 1
        self.policy.on_routed(route, chosen)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        route = self.routes.pop(internal_request_id, None)
        self.chosen.pop(internal_request_id, None)
        if route is None:
            return
        name = replica_id.to_full_id_str()
        self.in_flight[name] = max(0, self.in_flight[name] - 1)
        self.policy.on_finished(route.request_id, name)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        name = replica_id.to_full_id_str()
        self._blocks.pop(name, None)
        self._stats_seen.pop(name, None)
        self.in_flight.pop(name, None)
        self.policy.remove_replica(name)


def _load(state: ReplicaState) -> tuple[int, float, str]:
    return (state.num_running + state.num_waiting + state.in_flight, state.kv_cache_usage, state.name)


def _route_request(pending_request: PendingRequest | None) -> RouteRequest | None:
    """What the policy sees of a ``generate`` call: its first sequence's prompt and session, keyed
    by Ray Serve's internal id (unique per call, so a retry is a new route)."""
    if pending_request is None or pending_request.metadata.call_method != "generate" or not pending_request.args:
        return None
    requests = pending_request.args[0]
    if not isinstance(requests, list) or not requests or not isinstance(requests[0], EngineRequest):
        return None
    first = requests[0]
    return RouteRequest(pending_request.metadata.internal_request_id, token_ids=first.prompt_token_ids,
                        session=getattr(first, "session_id", None), cache_salt=first.cache_salt)


# --- deploying and the client --------------------------------------------------------------------


def deploy(settings: RayServeSettings, config: EngineConfig, model_dir: Path, vocab_size: int | None) -> Any:
    """Connect to (or start) a Ray cluster and run the engine deployment; returns its handle once
    the replicas have loaded the model. Blocking: call it off the event loop."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    threads = settings.threads_per_engine
    if settings.address is None:
        cpus = os.cpu_count() or 1
        threads = threads or max(1, cpus // settings.most_replicas)
        cpus_per_replica = round(cpus / settings.most_replicas, 2)
    else:
        threads = threads or 1
        cpus_per_replica = float(threads)
    if not ray.is_initialized():
        if settings.address is None:
            # "local": always a new cluster of our own, never one that `ray start` left running here.
            ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, object_store_memory=96 * 1024 * 1024,
                     logging_level=logging.WARNING, log_to_driver=True)
        else:
            ray.init(address=settings.address, logging_level=logging.WARNING)
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    serve.start(proxy_location="Disabled", logging_config=quiet)  # tokenline's own server is the ingress
    if settings.routing_policy == "kv_events":
        config = dataclasses.replace(config, enable_kv_cache_events=True)
    config = dataclasses.replace(config, num_threads=threads)
    options: dict[str, Any] = {
        "name": "engine",
        "ray_actor_options": {"num_cpus": cpus_per_replica},
        "max_ongoing_requests": settings.max_ongoing_requests,
        "logging_config": quiet,
        "request_router_config": RequestRouterConfig(
            request_router_class=TokenlineRequestRouter,
            request_router_kwargs={"policy": settings.routing_policy, "session_affinity": settings.session_affinity,
                                   "seed": config.seed},
            request_routing_stats_period_s=settings.routing_stats_period_s,
        ),
    }
    autoscaling = settings.autoscaling_config()
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = settings.num_replicas
    app = serve.deployment(EngineReplica, **options).bind(config, str(model_dir), vocab_size)
    return serve.run(app, name=settings.app_name, route_prefix=None)


def teardown(settings: RayServeSettings) -> None:
    """Remove the deployment; a local cluster this process started goes with it."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if settings.address is None:
            serve.shutdown()
        else:
            serve.delete(settings.app_name)  # other apps on a shared cluster stay
    finally:
        ray.shutdown()


class RayEngineClient(EngineClient):
    """The API process's engine: Ray Serve replicas behind one ``EngineClient``. Each caller
    request (all its ``n`` sequences) is one streaming ``generate`` call that the router sends to
    one replica; Ray Serve restarts dead replicas, so this client has no restart policy."""

    def __init__(self, settings: RayServeSettings, config: EngineConfig, model_dir: Path,
                 vocab_size: int | None) -> None:
        super().__init__(restart=None)
        self.settings = settings
        self.config = config
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.handle: Any = None
        self.served: Counter[str] = Counter()  # replica -> caller requests it served
        self._replica_stats: dict[str, EngineStats] = {}
        self._request_replica: dict[str, str] = {}  # engine request id -> replica serving it
        self._pumps: dict[OutputCollector, asyncio.Task[None]] = {}
        self._calls: set[asyncio.Task[Any]] = set()
        self._starter: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._starter = asyncio.get_running_loop().create_task(self._deploy(), name="ray-deploy")

    async def _deploy(self) -> None:
        try:
            self.handle = await asyncio.to_thread(deploy, self.settings, self.config, self.model_dir,
                                                  self.vocab_size)
            info = await self.handle.model_info.remote()
        except Exception as exc:  # noqa: BLE001 - any failure to deploy is the engine's failure to start
            self._on_dead(f"Ray Serve deployment failed: {exc!r}")
            return
        scaling = self.settings.autoscaling_config()
        replicas = (f"{scaling['min_replicas']}..{scaling['max_replicas']} (autoscaling)" if scaling
                    else str(self.settings.num_replicas))
        logger.info("Ray Serve: %s replica(s) of %s ready, routing policy %s", replicas, self.model_dir.name,
                    self.settings.routing_policy)
        self._set_ready(info)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._starter is not None and not self._starter.done():
            self._starter.cancel()
        for task in list(self._pumps.values()):
            task.cancel()
        try:
            await asyncio.wait_for(asyncio.to_thread(teardown, self.settings), timeout + 20.0)
        except Exception:  # noqa: BLE001 - shutting down: report and go on
            logger.exception("Ray Serve teardown failed")
        self._on_dead("the engine has shut down")

    def _submit(self, request: EngineRequest) -> None:  # pragma: no cover - add() is overridden
        raise NotImplementedError

    def _cancel(self, request_id: str) -> None:  # pragma: no cover - abort() is overridden
        raise NotImplementedError

    def _transport_alive(self) -> bool:
        return not self._stopping

    def add(self, requests: list[EngineRequest]) -> OutputCollector:
        if not self.alive or self.handle is None:
            raise EngineDeadError(self.error or "the engine is not running")
        collector = OutputCollector([r.request_id for r in requests])
        self._live.add(collector)
        for request in requests:
            self._collectors[request.request_id] = collector
        task = asyncio.get_running_loop().create_task(self._pump(collector, requests),
                                                      name=f"ray-{requests[0].request_id}")
        self._pumps[collector] = task
        task.add_done_callback(lambda _t, c=collector: self._pumps.pop(c, None))
        return collector

    async def _pump(self, collector: OutputCollector, requests: list[EngineRequest]) -> None:
        """One ``generate`` stream into the collector. A replica that fails before any output
        (dead actor, engine restarting) gets the request once more: the caller saw no byte, and
        Ray Serve's router has dropped a dead replica by then."""
        unfinished = {r.request_id for r in requests}
        failed: str | None = None
        for attempt in range(2):
            replica: str | None = None
            produced = False
            stream = self.handle.options(stream=True).generate.remote(requests, failed)
            try:
                async for item in stream:
                    if isinstance(item, str):
                        replica = item
                        self.served[replica] += 1
                        for request in requests:
                            self._request_replica[request.request_id] = replica
                        pending = [i for i in unfinished if i in self._aborting]
                        if pending:  # aborted before we knew where it ran
                            self._send_abort(replica, pending)
                    elif isinstance(item, ReplicaRefusal):
                        collector.fail(EngineRequestError(item.param, item.message))
                        return
                    elif isinstance(item, ReplicaChunk) and replica is not None:
                        produced = produced or bool(item.outputs)
                        unfinished -= {o.request_id for o in item.outputs if o.finished}
                        self._replica_stats[replica] = item.stats
                        self._deliver(StepOutputs(item.outputs, sum_stats(list(self._replica_stats.values())),
                                                  [], []))
                if unfinished:
                    collector.fail(EngineDeadError(f"replica {replica} ended the stream before the request finished"))
                return
            except asyncio.CancelledError:
                stream.cancel()  # the replica's generator aborts the engine requests
                raise
            except Exception as error:  # noqa: BLE001 - a replica's failure is judged here
                aborted = any(i in self._aborting for i in unfinished)
                if attempt == 0 and not produced and not aborted and not self._stopping:
                    failed = replica
                    logger.warning("request %s failed on replica %s before its first token (%s); retrying",
                                   requests[0].request_id, replica, error)
                    continue
                logger.warning("request %s failed on replica %s: %s", requests[0].request_id, replica, error)
                collector.fail(EngineDeadError(f"replica {replica} failed: {error}"))
                return
            finally:
                for request in requests:
                    self._request_replica.pop(request.request_id, None)

    def _send_abort(self, replica: str, request_ids: list[str]) -> None:
        async def call() -> None:
            try:
                await self.handle.abort.remote(replica, request_ids)
            except Exception as error:  # noqa: BLE001 - the stream's end reports the outcome
                logger.warning("abort of %s on replica %s failed: %s", request_ids, replica, error)

        task = asyncio.get_running_loop().create_task(call())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[str, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._collectors and request_id not in self._aborting:
                self._aborting.add(request_id)
                replica = self._request_replica.get(request_id)
                if replica is not None:  # else the pump sends it once the replica is known
                    by_replica.setdefault(replica, []).append(request_id)
        for replica, ids in by_replica.items():
            self._send_abort(replica, ids)

    def forget(self, collector: OutputCollector) -> None:
        task = self._pumps.get(collector)
        if task is not None and not task.done():
            task.cancel()  # the consumer let go early: cancel the stream
        super().forget(collector)

"""``FleetClient``: many engines behind one ``EngineClient``, a routing policy choosing per request.

The gateway and the request processor talk to a fleet exactly as to one engine. Each caller
request (all its ``n`` sequences, so they share a prefix) goes to one member, chosen by the
``RoutingPolicy`` over the members that are ready, alive and not ejected. Members are any
``EngineClient``: local engine processes (``--data-parallel-size``), remote servers (``tokenline
router``), simulated replicas.

One task per request pumps the member's outputs into the fleet's collector. It is also where a
failure is judged: a request whose member fails before any output arrived is retried once on
another member (the caller never saw a byte), and that member is ejected for a while (passive
health); a failure after the first output ends the request with the error, as a single engine's
death would. A member's 4xx-class refusal (``EngineRequestError``) is the request's own fault
and is never retried.

Loads for the policy come from each member's latest stats plus the requests this fleet has in
flight there; KV events from members' steps feed the policy (precise prefix affinity), and an
engine death's ``AllBlocksCleared`` clears what the policy believed that member held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tokenline.engine.client import EngineClient, EngineDeadError, EngineRequestError, OutputCollector
from tokenline.engine.messages import EngineReady, EngineRequest, EngineStats, StepOutputs
from tokenline.router.policy import ReplicaState, RouteDecision, RouteRequest, RoutingPolicy

logger = logging.getLogger("tokenline.router")


@dataclass
class MemberCounters:
    """What the fleet saw of one member, for ``/metrics`` (per-upstream series)."""

    requests: int = 0  # caller requests routed there (retries counted where they landed)
    errors: int = 0  # requests that failed there (retried or not)
    retries: int = 0  # requests moved away from it before their first byte
    ejections: int = 0
    predicted_hit_tokens: int = 0  # prompt tokens the policy expected cached there
    reported_hit_tokens: int = 0  # prompt tokens the member reported as cached
    prompt_tokens: int = 0


class NoReplicaError(EngineDeadError):
    """No member can take a request now (all dead, loading or ejected)."""


class FleetClient(EngineClient):
    """Members behind one client. ``eject_s``: how long a member that failed a request before its
    first byte gets no new requests; ``ready_grace_s``: after the first member is ready, how long
    the fleet waits for the others before it reports ready anyway."""

    def __init__(
        self,
        members: dict[str, EngineClient],
        policy: RoutingPolicy,
        *,
        eject_s: float = 10.0,
        ready_grace_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not members:
            raise ValueError("a fleet needs at least one member")
        super().__init__(restart=None)  # members supervise themselves
        self.members = members
        self.policy = policy
        self.eject_s = eject_s
        self.ready_grace_s = ready_grace_s
        self._clock = clock
        self.counters: dict[str, MemberCounters] = {name: MemberCounters() for name in members}
        self.decisions: Counter[tuple[str, str]] = Counter()  # (member, reason) -> requests
        self._ejected_until: dict[str, float] = {}
        self._in_flight: Counter[str] = Counter()  # member -> caller requests there now
        self._request_member: dict[str, str] = {}  # engine request id -> member now serving it
        self._pumps: dict[OutputCollector, asyncio.Task[None]] = {}
        self._gave_up: set[str] = set()
        self._waiter: asyncio.Task[None] | None = None
        for name, member in members.items():
            member.add_step_listener(lambda step, name=name: self._on_member_step(name, step))
            member.on_give_up = lambda reason, name=name: self._member_gave_up(name, reason)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        for member in self.members.values():
            member.start()
        self._waiter = asyncio.get_running_loop().create_task(self._wait_members(), name="fleet-ready")

    async def _wait_members(self) -> None:
        waits = {asyncio.ensure_future(m.wait_ready()): name for name, m in self.members.items()}
        pending = set(waits)
        deadline: float | None = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    logger.error("replica %s failed to start: %s", waits[task], task.exception())
            if deadline is None and any(m.ready for m in self.members.values()):
                deadline = self._clock() + self.ready_grace_s
            if not done:  # the grace period ran out: serve with the members that are up
                break
        for task in pending:
            task.cancel()
        info = self._fleet_info()
        if info is not None:
            self._set_ready(info)
        else:
            self._on_dead("no replica started: " + "; ".join(
                f"{name}: {m.error}" for name, m in self.members.items() if m.error))

    def _fleet_info(self) -> EngineReady | None:
        ready = [m.info for m in self.members.values() if m.info is not None]
        if not ready:
            return None
        # The fleet's KV pool is the sum of its members' (what the live page and /metrics show).
        return dataclasses.replace(ready[0], num_kv_blocks=sum(i.num_kv_blocks for i in ready))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._waiter is not None:
            self._waiter.cancel()
        for task in list(self._pumps.values()):
            task.cancel()
        await asyncio.gather(*(m.shutdown(timeout) for m in self.members.values()), return_exceptions=True)

    def _submit(self, request: EngineRequest) -> None:  # pragma: no cover - add() is overridden
        raise NotImplementedError

    def _cancel(self, request_id: str) -> None:  # pragma: no cover - abort() is overridden
        raise NotImplementedError

    def _transport_alive(self) -> bool:
        return any(m.alive for m in self.members.values())

    @property
    def alive(self) -> bool:
        return not self._stopping and any(m.alive for m in self.members.values())

    @property
    def ready(self) -> bool:
        return self.info is not None and any(m.ready for m in self.members.values())

    @property
    def state(self) -> str:
        states = [m.state for m in self.members.values()]
        if "ok" in states and self.info is not None:
            return "ok"
        if self.info is None and self.error is None:
            return "loading"
        if "restarting" in states or "loading" in states:
            return "restarting"
        return "failed"

    @property
    def num_inflight(self) -> int:
        return sum(m.num_inflight for m in self.members.values())

    def backlog_tokens(self) -> int:
        return sum(c.backlog_tokens() for c in self._live)

    def _member_gave_up(self, name: str, reason: str) -> None:
        self._gave_up.add(name)
        logger.error("replica %s gave up: %s", name, reason)
        self.policy.remove_replica(name)
        if self._gave_up >= set(self.members) and self.on_give_up is not None:
            self.gave_up = True
            self.on_give_up(f"every replica gave up; last: {reason}")

    # --- routing -------------------------------------------------------------------------------

    def member_state(self, name: str) -> ReplicaState:
        member = self.members[name]
        stats, info = member.stats, member.info
        return ReplicaState(
            name=name, num_running=stats.num_running, num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage, in_flight=self._in_flight[name],
            block_size=info.block_size if info is not None else 16, num_kv_blocks=stats.num_kv_blocks,
        )

    def available(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Members that may take a new request now."""
        now = self._clock()
        return [name for name, m in self.members.items()
                if name not in exclude and m.ready and m.alive and self._ejected_until.get(name, 0.0) <= now]

    def eject(self, name: str, seconds: float | None = None) -> None:
        """No new requests to ``name`` for a while (a failure seen in passing, or a health check)."""
        self._ejected_until[name] = self._clock() + (self.eject_s if seconds is None else seconds)
        self.counters[name].ejections += 1
        logger.warning("replica %s ejected for %.1f s", name, self.eject_s if seconds is None else seconds)

    def member_healthy(self, name: str) -> bool:
        """``name`` may take new requests now (ready, alive, not ejected): /metrics' upstream_healthy."""
        return name in self.available()

    def _route(self, route: RouteRequest, exclude: set[str], retry: bool) -> RouteDecision:
        names = self.available(exclude)
        if not names:
            raise NoReplicaError("no replica is available to serve the request")
        if len(names) == 1 and not retry:
            decision = RouteDecision(names[0], "only_replica")
        else:
            decision = self.policy.choose(route, [self.member_state(n) for n in names])
            if retry:
                decision = dataclasses.replace(decision, reason="retry")
        self.policy.on_routed(route, decision)
        self.decisions[(decision.replica, decision.reason)] += 1
        counters = self.counters[decision.replica]
        counters.requests += 1
        counters.predicted_hit_tokens += decision.predicted_hit_tokens
        return decision

    def add(self, requests: list[EngineRequest]) -> OutputCollector:
        if not self.alive:
            raise EngineDeadError(self.error or "the engine is not running")
        first = requests[0]
        route = RouteRequest(first.request_id, token_ids=first.prompt_token_ids,
                             session=getattr(first, "session_id", None), cache_salt=first.cache_salt)
        decision = self._route(route, set(), retry=False)  # NoReplicaError reaches the caller now
        collector = OutputCollector([r.request_id for r in requests])
        self._live.add(collector)
        for request in requests:
            self._collectors[request.request_id] = collector
        task = asyncio.get_running_loop().create_task(
            self._pump(collector, requests, route, decision.replica), name=f"fleet-{first.request_id}")
        self._pumps[collector] = task
        task.add_done_callback(lambda _t, c=collector: self._pumps.pop(c, None))
        return collector

    async def _pump(self, collector: OutputCollector, requests: list[EngineRequest], route: RouteRequest,
                    name: str) -> None:
        tried: set[str] = set()
        while True:
            current, member = name, self.members[name]
            tried.add(current)
            for request in requests:
                self._request_member[request.request_id] = current
            self._in_flight[current] += 1
            got_output = False
            child: OutputCollector | None = None
            try:
                child = member.add(requests)
                while not child.finished:
                    for output in await child.get():
                        got_output = True
                        if output.finished:
                            self._collectors.pop(output.request_id, None)
                            self._aborting.discard(output.request_id)
                            self.counters[current].prompt_tokens += output.num_prompt_tokens
                            self.counters[current].reported_hit_tokens += output.num_cached_tokens
                        collector.put(output)
                return
            except asyncio.CancelledError:
                if child is not None:
                    member.abort([r.request_id for r in requests])
                raise
            except EngineRequestError as error:
                collector.fail(error)
                return
            except Exception as error:  # noqa: BLE001 - a member's failure is judged here
                self.counters[current].errors += 1
                aborted = any(r.request_id in self._aborting for r in requests)
                if got_output or aborted or self._stopping:
                    collector.fail(error if isinstance(error, EngineDeadError) else EngineDeadError(str(error)))
                    return
                self.counters[current].retries += 1
                self.eject(current)
                try:
                    name = self._route(route, tried, retry=True).replica
                except NoReplicaError:
                    collector.fail(EngineDeadError(f"replica {current} failed before the first token and no "
                                                   f"other replica is available: {error}"))
                    return
                logger.warning("request %s failed on replica %s before its first token (%s); retrying on %s",
                               route.request_id, current, error, name)
            finally:
                self._in_flight[current] -= 1
                if child is not None:
                    member.forget(child)
                self.policy.on_finished(route.request_id, current)

    def abort(self, request_ids: list[str]) -> None:
        by_member: dict[str, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._collectors and request_id not in self._aborting:
                self._aborting.add(request_id)
                name = self._request_member.get(request_id)
                if name is not None:
                    by_member.setdefault(name, []).append(request_id)
        for name, ids in by_member.items():
            self.members[name].abort(ids)

    def forget(self, collector: OutputCollector) -> None:
        task = self._pumps.get(collector)
        if task is not None and not task.done():
            task.cancel()  # the consumer let go early: the pump aborts and releases the member's side
        super().forget(collector)
        for request_id in collector.request_ids:
            self._request_member.pop(request_id, None)

    # --- what members report -------------------------------------------------------------------

    def _on_member_step(self, name: str, step: StepOutputs) -> None:
        self.stats = self._sum_stats()
        if step.kv_events:
            try:
                self.policy.on_kv_events(name, step.kv_events)
            except Exception:  # noqa: BLE001 - a policy bug must not stop outputs
                logger.exception("routing policy failed on KV events from %s", name)
        for listener in self._listeners:
            try:
                listener(step)
            except Exception:  # noqa: BLE001 - an observer must never break serving
                logger.exception("step listener failed")

    def _sum_stats(self) -> EngineStats:
        return sum_stats([m.stats for m in self.members.values()])


def sum_stats(members: list[EngineStats]) -> EngineStats:
    """Many engines' load as one: counts added, KV usage over the summed pool (the fleet's view)."""
    total = EngineStats()
    numeric = [f.name for f in dataclasses.fields(EngineStats) if f.name != "kv_cache_usage"]
    for stats in members:
        for field_name in numeric:
            setattr(total, field_name, getattr(total, field_name) + getattr(stats, field_name))
    if total.num_kv_blocks:
        total.kv_cache_usage = 1.0 - total.num_free_kv_blocks / total.num_kv_blocks
    else:
        total.kv_cache_usage = sum(s.kv_cache_usage for s in members) / max(1, len(members))
    return total

"""FleetClient's own logic — routing per caller request, retry before the first output, ejection,
aborts reaching the right member, summed stats, KV events to the policy — over members that are
real ``EngineClient`` subclasses driven by a script instead of a model (the model is not what is
under test here; tests/e2e/test_data_parallel.py runs real engines)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tokenline.engine.client import EngineClient, EngineDeadError, EngineRequestError
from tokenline.engine.kv_events import BlockStored, KVCacheEvent
from tokenline.engine.messages import (
    EngineOutput,
    EngineReady,
    EngineRequest,
    EngineStats,
    FinishReason,
    StepOutputs,
)
from tokenline.router.fleet import FleetClient, NoReplicaError
from tokenline.router.policy import ReplicaState, RouteDecision, RouteRequest, RoutingPolicy
from tokenline.sampling_params import SamplingParams


class ScriptedMember(EngineClient):
    """Answers each request with ``tokens`` outputs of one token, one per loop turn; ``fail_first``
    makes it die before any output; ``fail_after`` after that many outputs."""

    def __init__(self, name: str, tokens: int = 3, fail_first: bool = False, fail_after: int | None = None,
                 refuse: bool = False) -> None:
        super().__init__()
        self.name, self.tokens, self.fail_first, self.fail_after, self.refuse = name, tokens, fail_first, fail_after, refuse
        self.submitted: list[str] = []
        self.cancelled: list[str] = []
        self.step_stats = EngineStats(num_running=1, num_kv_blocks=10, num_free_kv_blocks=5, prefix_cache_hits=2)

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._set_ready, EngineReady(2048, 10, 16, "float32"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True

    def _transport_alive(self) -> bool:
        return True

    def _submit(self, request: EngineRequest) -> None:
        self.submitted.append(request.request_id)
        asyncio.get_running_loop().create_task(self._produce(request))

    def _cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self._deliver(StepOutputs([EngineOutput(request_id, [], finish_reason=FinishReason.ABORT)], self.step_stats))

    async def _produce(self, request: EngineRequest) -> None:
        await asyncio.sleep(0)
        if self.refuse:
            self._reject(request.request_id, "max_tokens", "too long")
            return
        if self.fail_first:
            self._on_dead("scripted death")
            return
        for i in range(self.tokens):
            if request.request_id in self.cancelled:
                return
            if self.fail_after is not None and i == self.fail_after:
                self._on_dead("scripted death mid-stream")
                return
            last = i == self.tokens - 1
            output = EngineOutput(request.request_id, [100 + i], finish_reason=FinishReason.LENGTH if last else None,
                                  num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=16 if last else 0,
                                  num_output_tokens=i + 1)
            events: list[KVCacheEvent] = [BlockStored([self.name.encode()], None, list(range(16)), 16)] if last else []
            self._deliver(StepOutputs([output], self.step_stats, events))
            await asyncio.sleep(0.001)


class Scripted(RoutingPolicy):
    """Sends everything to ``order[0]`` unless it is not offered; records what it was told."""

    name = "scripted"

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.events: list[tuple[str, int]] = []
        self.finished: list[tuple[str, str]] = []
        self.offered: list[list[ReplicaState]] = []

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RouteDecision:
        self.offered.append(list(replicas))
        names = [r.name for r in replicas]
        return RouteDecision(next(n for n in self.order if n in names), "prefix", predicted_hit_tokens=16)

    def on_kv_events(self, replica: str, events: Sequence[KVCacheEvent]) -> None:
        self.events.append((replica, len(events)))

    def on_finished(self, request_id: str, replica: str) -> None:
        self.finished.append((request_id, replica))


def _request(request_id: str, n_tokens: int = 20) -> EngineRequest:
    return EngineRequest(request_id, list(range(n_tokens)), SamplingParams(max_tokens=3))


async def _drain(collector) -> list[EngineOutput]:
    outputs = []
    while not collector.finished:
        outputs.extend(await collector.get())
    return outputs


async def _fleet(members: dict[str, ScriptedMember], policy: RoutingPolicy) -> FleetClient:
    fleet = FleetClient(members, policy, eject_s=30.0)
    fleet.start()
    await fleet.wait_ready(timeout=5)
    return fleet


def test_routes_each_request_to_the_policys_choice_and_counts_it() -> None:
    async def run() -> None:
        members = {"a": ScriptedMember("a"), "b": ScriptedMember("b")}
        policy = Scripted(["b", "a"])
        fleet = await _fleet(members, policy)
        outputs = await _drain(fleet.add([_request("r1-0"), _request("r1-1")]))
        assert members["b"].submitted == ["r1-0", "r1-1"] and members["a"].submitted == []  # n stays together
        assert sum(len(o.new_token_ids) for o in outputs) == 6
        assert fleet.counters["b"].requests == 1 and fleet.counters["b"].predicted_hit_tokens == 16
        assert fleet.counters["b"].reported_hit_tokens == 32  # two sequences, 16 cached each
        assert fleet.decisions[("b", "prefix")] == 1
        assert ("b", 1) in policy.events  # the member's KV events reached the policy
        await asyncio.sleep(0.01)
        assert policy.finished == [("r1-0", "b")]
        assert fleet.info is not None and fleet.info.num_kv_blocks == 20  # the pools add up
        members["a"].stats = EngineStats(num_running=3, num_kv_blocks=10, num_free_kv_blocks=10, prefix_cache_hits=1)
        members["a"]._deliver(StepOutputs([], members["a"].stats))  # a step of a's own: the sums move
        assert fleet.stats.num_running == 4 and fleet.stats.prefix_cache_hits == 3
        assert fleet.stats.kv_cache_usage == pytest.approx(0.25)  # 5 of 20 blocks in use
        assert fleet.member_state("a").num_kv_blocks == 10  # what bounds the prefix policy's tree
        await fleet.shutdown()

    asyncio.run(run())


def test_a_member_that_fails_before_the_first_output_is_ejected_and_the_request_retried() -> None:
    async def run() -> None:
        members = {"a": ScriptedMember("a", fail_first=True), "b": ScriptedMember("b")}
        fleet = await _fleet(members, Scripted(["a", "b"]))
        outputs = await _drain(fleet.add([_request("r1-0")]))
        assert [t for o in outputs for t in o.new_token_ids] == [100, 101, 102]
        assert members["b"].submitted == ["r1-0"]
        assert fleet.counters["a"].retries == 1 and fleet.counters["a"].ejections == 1
        assert fleet.decisions[("b", "retry")] == 1
        assert fleet.available() == ["b"]  # a stays out while ejected (and dead)
        await fleet.shutdown()

    asyncio.run(run())


def test_a_failure_after_the_first_output_ends_the_request_with_the_error() -> None:
    async def run() -> None:
        members = {"a": ScriptedMember("a", fail_after=1), "b": ScriptedMember("b")}
        fleet = await _fleet(members, Scripted(["a", "b"]))
        collector = fleet.add([_request("r1-0")])
        with pytest.raises(EngineDeadError):
            await _drain(collector)
        assert members["b"].submitted == []  # bytes were out: no silent replay elsewhere
        await fleet.shutdown()

    asyncio.run(run())


def test_a_refusal_is_the_requests_own_and_is_not_retried() -> None:
    async def run() -> None:
        members = {"a": ScriptedMember("a", refuse=True), "b": ScriptedMember("b")}
        fleet = await _fleet(members, Scripted(["a", "b"]))
        with pytest.raises(EngineRequestError):
            await _drain(fleet.add([_request("r1-0")]))
        assert members["b"].submitted == [] and fleet.available() == ["a", "b"]
        await fleet.shutdown()

    asyncio.run(run())


def test_abort_reaches_the_member_serving_the_request() -> None:
    async def run() -> None:
        members = {"a": ScriptedMember("a", tokens=1000), "b": ScriptedMember("b")}
        fleet = await _fleet(members, Scripted(["a"]))
        collector = fleet.add([_request("r1-0")])
        await collector.get()
        fleet.abort(["r1-0"])
        outputs = await _drain(collector)
        assert outputs[-1].finish_reason == FinishReason.ABORT
        assert members["a"].cancelled == ["r1-0"] and members["b"].cancelled == []
        fleet.forget(collector)
        assert fleet.num_inflight == 0
        await fleet.shutdown()

    asyncio.run(run())


def test_no_member_available_is_an_engine_dead_error_at_once() -> None:
    async def run() -> None:
        members = {"a": ScriptedMember("a")}
        fleet = await _fleet(members, Scripted(["a"]))
        fleet.eject("a")
        with pytest.raises(NoReplicaError):
            fleet.add([_request("r1-0")])
        await fleet.shutdown()

    asyncio.run(run())

"""The supervisor in the ``EngineClient`` base, transport-agnostic: a transport whose engine
"dies" on demand. The real process transport is killed with SIGKILL in
tests/e2e/test_engine_supervisor.py; here the policy is checked exactly and in milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from tokenline.engine.client import EngineClient, EngineDeadError, RestartPolicy
from tokenline.engine.kv_events import AllBlocksCleared
from tokenline.engine.messages import EngineReady, EngineRequest, StepOutputs
from tokenline.sampling_params import SamplingParams


class FlakyTransport(EngineClient):
    """Starts get ready at once, unless ``fail_starts`` says the next ones die while starting."""

    def __init__(self, policy: RestartPolicy | None, fail_starts: int = 0) -> None:
        super().__init__(policy)
        self.starts = 0
        self.reaped = 0
        self.fail_starts = fail_starts
        self.up = False

    def start(self) -> None:
        self.starts += 1
        loop = asyncio.get_running_loop()
        if self.fail_starts > 0:
            self.fail_starts -= 1
            loop.call_soon(self._on_dead, "engine failed to start: boom")
        else:
            self.up = True
            loop.call_soon(self._set_ready, EngineReady(max_model_len=64, num_kv_blocks=8, block_size=16, dtype="float32"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()

    def _submit(self, request: EngineRequest) -> None:
        pass

    def _cancel(self, request_id: str) -> None:
        pass

    def _transport_alive(self) -> bool:
        return self.up

    async def _reap(self) -> None:
        self.reaped += 1

    def die(self) -> None:
        self.up = False
        self._on_dead("the engine process exited unexpectedly")


def request(request_id: str) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4).with_defaults())


def test_death_fails_in_flight_then_restarts_and_listeners_stay() -> None:
    async def go() -> None:
        client = FlakyTransport(RestartPolicy(max_restarts=3, window_s=60, backoff_base_s=0.01))
        steps: list[StepOutputs] = []
        client.add_step_listener(steps.append)
        client.start()
        await client.wait_ready(1)
        assert client.state == "ok"
        collector = client.add([request("a-0")])
        client.die()
        with pytest.raises(EngineDeadError):
            await collector.get()
        assert client.state == "restarting" and not client.alive
        with pytest.raises(EngineDeadError):
            client.add([request("b-0")])  # the serving layer turns this into a 503
        # Observers learn the dead engine's cache is gone.
        assert any(isinstance(e, AllBlocksCleared) for s in steps for e in s.kv_events)
        for _ in range(100):
            if client.state == "ok":
                break
            await asyncio.sleep(0.01)
        assert client.state == "ok" and client.restarts == 1 and client.reaped == 1 and client.starts == 2
        client.forget(collector)
        # The same listener hears the new engine.
        client._deliver(StepOutputs([], client.stats, [], []))
        assert len(steps) == 2
        await client.shutdown()

    asyncio.run(go())


def test_backoff_doubles_and_a_crash_loop_gives_up_once() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_base_s=0.02, backoff_max_s=1.0)
    assert [policy.backoff(k) for k in range(4)] == [0.02, 0.04, 0.08, 0.16]
    assert RestartPolicy(backoff_base_s=1, backoff_max_s=5).backoff(10) == 5

    async def go() -> None:
        client = FlakyTransport(policy, fail_starts=10)  # every start dies
        reasons: list[str] = []
        client.on_give_up = reasons.append
        client.start()
        for _ in range(200):
            if client.gave_up:
                break
            await asyncio.sleep(0.01)
        assert client.gave_up and client.state == "failed"
        assert client.starts == 3  # the first start and two restarts; the third death gives up
        await asyncio.sleep(0.05)
        assert len(reasons) == 1 and "crash loop: 3 deaths within 60 s" in reasons[0]
        assert "engine failed to start: boom" in reasons[0]

    asyncio.run(go())


def test_without_a_policy_a_dead_engine_stays_dead() -> None:
    async def go() -> None:
        client = FlakyTransport(None)
        client.start()
        await client.wait_ready(1)
        client.die()
        await asyncio.sleep(0.05)
        assert client.state == "failed" and client.starts == 1

    asyncio.run(go())


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)


def test_a_death_not_yet_reported_is_never_ok() -> None:
    """kill -9 lands between two messages: the process is gone before the reader says so. /health
    must not answer 200 for the old engine in that moment (the reliability suite once saw it)."""

    async def go() -> None:
        for policy, expected in ((RestartPolicy(backoff_base_s=0.01), "restarting"), (None, "failed")):
            client = FlakyTransport(policy)
            client.start()
            await client.wait_ready(1)
            assert client.state == "ok"
            client.up = False  # dead, unreported
            assert client.state == expected and not client.alive
            await client.shutdown()

    asyncio.run(go())

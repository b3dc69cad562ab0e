"""``EngineClient``: what the gateway and the request processor need from an engine, wherever it runs.

A local engine process implements it today (``EngineProcessClient``); a remote server and a Ray
replica implement the same verbs — add, abort, stream outputs, stats, model info — so the code in
front of an engine never knows which one it has.

The routing of outputs is the same for every transport and lives here: outputs for one caller
request (all its ``n`` sequences) land in an ``OutputCollector``. While the consumer is slow, new
outputs for a sequence are merged into the one pending record, so memory per request is bounded
by its token ids (at most ``max_tokens``), never by how long the client stalls.

Supervision is also the same for every transport and lives here: when the engine dies, in-flight
requests fail with ``EngineDeadError``, and with a ``RestartPolicy`` the client reaps the dead
engine and starts a new one after an exponential backoff; too many deaths within the policy's
window and it gives up (``on_give_up``), so whoever runs the server can exit and be restarted.
Step listeners stay registered across restarts.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenline.engine.kv_events import AllBlocksCleared
from tokenline.engine.messages import EngineOutput, EngineReady, EngineRequest, EngineStats, StepOutputs
from tokenline.setting_field import RESTARTS, SERVE, setting

logger = logging.getLogger("tokenline.engine")

StepListener = Callable[[StepOutputs], None]


class EngineDeadError(RuntimeError):
    """The engine is gone; in-flight requests cannot complete."""


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead engine comes back: attempt ``k`` (0-based) waits ``min(backoff_max_s,
    backoff_base_s * 2**k)``, where ``k`` counts the deaths still inside the window; more than
    ``max_restarts`` deaths within ``window_s`` seconds is a crash loop, and the client gives up."""

    max_restarts: int = setting(
        5, "--engine-restart-max", group=RESTARTS, commands={SERVE}, type=int,
        help="restarts of a dead engine allowed within --engine-restart-window; one more death exits the server "
             "with status 3 (0 = never restart)")
    window_s: float = setting(300.0, "--engine-restart-window", group=RESTARTS, commands={SERVE}, type=float,
                              help="seconds (crash-loop window)")
    backoff_base_s: float = setting(1.0, "--engine-restart-backoff", group=RESTARTS, commands={SERVE}, type=float,
                                    help="seconds before the first restart; doubles with each death in the window")
    backoff_max_s: float = setting(30.0, "--engine-restart-backoff-max", group=RESTARTS, commands={SERVE},
                                   type=float, help="longest wait before a restart, in seconds")

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("restart policy: max_restarts >= 0, window_s > 0 and backoffs >= 0 required")

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** min(attempt, 30))


class EngineRequestError(ValueError):
    """The engine refused a request; ``param`` names the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class OutputCollector:
    """Outputs of a group of engine requests, merged per request until the consumer takes them."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._pending: dict[str, EngineOutput] = {}
        self._failure: Exception | None = None
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def backlog_tokens(self) -> int:
        """Generated tokens not yet taken by the consumer (what a slow client leaves here)."""
        return sum(len(o.new_token_ids) for o in self._pending.values())

    def put(self, output: EngineOutput) -> None:
        pending = self._pending.get(output.request_id)
        if pending is None:
            self._pending[output.request_id] = output
        else:
            _merge_into(pending, output)
        self._event.set()

    def fail(self, error: Exception) -> None:
        self._failure = error
        self._event.set()

    async def get(self) -> list[EngineOutput]:
        """Wait for news; return one merged output per request that has some. A failure is
        final: every later call raises it at once (the receipt's last look must not wait)."""
        if self._failure is not None:
            raise self._failure
        await self._event.wait()
        self._event.clear()
        if self._failure is not None:
            raise self._failure
        outputs = list(self._pending.values())
        self._pending.clear()
        for output in outputs:
            if output.finished:
                self.unfinished.discard(output.request_id)
        return outputs


def _merge_into(pending: EngineOutput, newer: EngineOutput) -> None:
    pending.new_token_ids.extend(newer.new_token_ids)
    if newer.new_logprobs:
        pending.new_logprobs = (pending.new_logprobs or []) + newer.new_logprobs
    pending.prompt_logprobs = pending.prompt_logprobs or newer.prompt_logprobs
    pending.finish_reason = newer.finish_reason
    pending.stop_reason = newer.stop_reason
    pending.num_cached_tokens = newer.num_cached_tokens
    pending.num_output_tokens = newer.num_output_tokens
    pending.timings = newer.timings or pending.timings


class EngineClient(abc.ABC):
    """An engine seen from the event loop. Subclasses move messages; this class routes them.

    A subclass implements ``start``, ``shutdown``, ``_submit``, ``_cancel`` and ``_transport_alive``
    (and ``_reap`` if a dead engine leaves something to release), and reports what arrives through
    ``_set_ready``, ``_deliver``, ``_reject`` and ``_on_dead`` (all called on the event loop's
    thread). ``start`` must work again after a death: the supervisor calls it to restart.
    """

    def __init__(self, restart: RestartPolicy | None = None) -> None:
        self.info: EngineReady | None = None  # the model's facts, once the engine is ready
        self.error: str | None = None  # why the engine is gone, once it is
        self.stats = EngineStats()  # the latest load snapshot
        self._collectors: dict[str, OutputCollector] = {}  # engine request id -> its collector
        self._live: set[OutputCollector] = set()  # collectors whose consumer has not let go yet
        self._aborting: set[str] = set()  # abort sent, final output not yet back
        self._listeners: list[StepListener] = []
        self._ready = asyncio.Event()
        self._stopping = False
        self.restart_policy = restart  # None: a dead engine stays dead
        self.restarting = False  # between a death and the next engine's readiness
        self.gave_up = False  # a crash loop: no more restarts
        self.restarts = 0  # engines started after a death, over the client's life
        self.on_give_up: Callable[[str], None] | None = None  # told why, once
        self._deaths: list[float] = []  # monotonic times of deaths inside the policy's window
        self._supervisor: asyncio.Task[None] | None = None

    # --- what a transport implements ------------------------------------------------------------

    @abc.abstractmethod
    def start(self) -> None:
        """Begin connecting or loading; returns at once (``wait_ready`` waits)."""

    @abc.abstractmethod
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (or the connection to it)."""

    @abc.abstractmethod
    def _submit(self, request: EngineRequest) -> None:
        """Send one request to the engine."""

    @abc.abstractmethod
    def _cancel(self, request_id: str) -> None:
        """Ask the engine to abort one request; it answers with the request's final output."""

    @abc.abstractmethod
    def _transport_alive(self) -> bool:
        """The engine (or the link to it) is still there."""

    async def _reap(self) -> None:  # noqa: B027 - a transport with nothing to release keeps this
        """Release what a dead engine left behind (a process to wait for), before a restart."""

    # --- state ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def alive(self) -> bool:
        return self.error is None and self._transport_alive()

    @property
    def state(self) -> str:
        """``ok``, ``loading``, ``restarting`` (a new engine is on its way), ``failed`` (dead for good)."""
        if self.restarting and not self.gave_up:
            return "restarting"
        if self.error is not None:
            return "failed"
        if self.info is None:
            return "loading"
        if not self._transport_alive():
            # Dead, and the reader has not reported it yet (a kill -9 lands between two messages):
            # never "ok" for the moment in between.
            return "restarting" if self.restart_policy is not None and not self._stopping else "failed"
        return "ok"

    @property
    def pid(self) -> int | None:
        """The engine's process id where it runs in a local process."""
        return None

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        await asyncio.wait_for(self._ready.wait(), timeout)
        if self.info is None:
            raise EngineDeadError(self.error or "engine failed to start")
        return self.info

    @property
    def num_inflight(self) -> int:
        return len(self._collectors)

    def backlog_tokens(self) -> int:
        """Tokens produced but not yet taken by their consumers, finished requests included."""
        return sum(c.backlog_tokens() for c in self._live)

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener`` with every step's outputs, stats, records and events, in order."""
        self._listeners.append(listener)

    # --- requests ------------------------------------------------------------------------------

    def add(self, requests: list[EngineRequest]) -> OutputCollector:
        """Send requests to the engine; their outputs arrive in the returned collector."""
        if not self.alive:
            raise EngineDeadError(self.error or "the engine is not running")
        collector = OutputCollector([r.request_id for r in requests])
        self._live.add(collector)
        for request in requests:
            self._collectors[request.request_id] = collector
            self._submit(request)
        return collector

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (no-op for finished ones); the engine frees them before its next step and
        answers with their final output (the tokens actually produced), routed as usual."""
        for request_id in request_ids:
            if request_id in self._collectors and request_id not in self._aborting and self.alive:
                self._aborting.add(request_id)
                self._cancel(request_id)

    def forget(self, collector: OutputCollector) -> None:
        """The consumer is done with a collector: stop counting its backlog, drop its routes."""
        self._live.discard(collector)
        for request_id in collector.request_ids:
            self._collectors.pop(request_id, None)
            self._aborting.discard(request_id)

    # --- what a transport reports --------------------------------------------------------------

    def _set_ready(self, info: EngineReady) -> None:
        self.info = info
        self._ready.set()

    def _deliver(self, step: StepOutputs) -> None:
        self.stats = step.stats
        for output in step.outputs:
            collector = self._collectors.get(output.request_id)
            if collector is None:
                continue  # its consumer has let go already
            collector.put(output)
            if output.finished:
                del self._collectors[output.request_id]
                self._aborting.discard(output.request_id)
        for listener in self._listeners:
            try:
                listener(step)
            except Exception:  # noqa: BLE001 - an observer must never break serving
                logger.exception("step listener failed")

    def _reject(self, request_id: str, param: str, message: str) -> None:
        collector = self._collectors.pop(request_id, None)
        if collector is not None:
            collector.fail(EngineRequestError(param, message))

    def _fail_request(self, request_id: str, error: str) -> None:
        """One request failed for the engine's reasons, not its own (a remote stream broke): it
        ends with ``EngineDeadError`` while the client and its other requests carry on (a fleet
        retries it elsewhere if nothing was delivered yet)."""
        collector = self._collectors.pop(request_id, None)
        self._aborting.discard(request_id)
        if collector is not None:
            collector.fail(EngineDeadError(error))

    def _on_dead(self, error: str) -> None:
        first = self.error is None
        if first:
            self.error = "the engine has shut down" if self._stopping else error
            if not self._stopping:
                logger.error("engine failed: %s", error)
        self._ready.set()
        failure = EngineDeadError(self.error or error)
        for collector in self._live:
            collector.fail(failure)
        self._collectors.clear()
        self._aborting.clear()
        if first and not self._stopping:
            # A new engine starts with an empty cache and no load: tell observers (a prefix index
            # applying KV events resets) instead of letting them keep the dead engine's picture.
            self._deliver(StepOutputs([], EngineStats(), [AllBlocksCleared()], []))
        if first and not self._stopping and self.restart_policy is not None and not self.gave_up:
            self.restarting = True
            self._supervisor = asyncio.get_running_loop().create_task(self._restart(), name="engine-restart")

    async def _restart(self) -> None:
        """Reap the dead engine, wait the backoff, start a new one; give up on a crash loop."""
        policy = self.restart_policy
        assert policy is not None
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < policy.window_s] + [now]
        if len(self._deaths) > policy.max_restarts:
            self.gave_up = True
            reason = (f"engine crash loop: {len(self._deaths)} deaths within {policy.window_s:g} s "
                      f"(--engine-restart-max {policy.max_restarts}); giving up. Last error: {self.error}")
            logger.critical(reason)
            if self.on_give_up is not None:
                self.on_give_up(reason)
            return
        delay = policy.backoff(len(self._deaths) - 1)
        logger.warning("engine died; restart %d of at most %d within %g s in %.2f s",
                       len(self._deaths), policy.max_restarts, policy.window_s, delay)
        await self._reap()
        await asyncio.sleep(delay)
        if self._stopping:
            return
        self.info = None
        self.error = None
        self._ready = asyncio.Event()
        self.restarts += 1
        self.start()
        await self._ready.wait()
        if self.info is not None and self.error is None:
            self.restarting = False
            logger.info("engine restarted (pid %s, restart %d)", self.pid, self.restarts)

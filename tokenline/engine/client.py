"""``EngineClient``: what the gateway and the request processor need from an engine, wherever it runs.

A local engine process implements it today (``EngineProcessClient``); a remote server and a Ray
replica implement the same verbs — add, abort, stream outputs, stats, model info — so the code in
front of an engine never knows which one it has.

The routing of outputs is the same for every transport and lives here: outputs for one caller
request (all its ``n`` sequences) land in an ``OutputCollector``. While the consumer is slow, new
outputs for a sequence are merged into the one pending record, so memory per request is bounded
by its token ids (at most ``max_tokens``), never by how long the client stalls.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable

from tokenline.engine.messages import EngineOutput, EngineReady, EngineRequest, EngineStats, StepOutputs

logger = logging.getLogger("tokenline.engine")

StepListener = Callable[[StepOutputs], None]


class EngineDeadError(RuntimeError):
    """The engine is gone; in-flight requests cannot complete."""


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
        """Wait for news; return one merged output per request that has some."""
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
    pending.finish_reason = newer.finish_reason
    pending.stop_reason = newer.stop_reason
    pending.num_cached_tokens = newer.num_cached_tokens
    pending.num_output_tokens = newer.num_output_tokens
    pending.timings = newer.timings or pending.timings


class EngineClient(abc.ABC):
    """An engine seen from the event loop. Subclasses move messages; this class routes them.

    A subclass implements ``start``, ``shutdown``, ``_submit``, ``_cancel`` and ``_transport_alive``,
    and reports what arrives through ``_set_ready``, ``_deliver``, ``_reject`` and ``_on_dead``
    (all called on the event loop's thread).
    """

    def __init__(self) -> None:
        self.info: EngineReady | None = None  # the model's facts, once the engine is ready
        self.error: str | None = None  # why the engine is gone, once it is
        self.stats = EngineStats()  # the latest load snapshot
        self._collectors: dict[str, OutputCollector] = {}  # engine request id -> its collector
        self._live: set[OutputCollector] = set()  # collectors whose consumer has not let go yet
        self._aborting: set[str] = set()  # abort sent, final output not yet back
        self._listeners: list[StepListener] = []
        self._ready = asyncio.Event()
        self._stopping = False

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

    # --- state ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def alive(self) -> bool:
        return self.error is None and self._transport_alive()

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

    def _on_dead(self, error: str) -> None:
        if self.error is None:
            self.error = "the engine has shut down" if self._stopping else error
            if not self._stopping:
                logger.error("engine failed: %s", error)
        self._ready.set()
        failure = EngineDeadError(self.error)
        for collector in self._live:
            collector.fail(failure)
        self._collectors.clear()
        self._aborting.clear()

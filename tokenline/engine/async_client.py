"""The API process's handle on the engine process: add / stream / abort, plus health and stats.

Outputs for one HTTP request (all its ``n`` sequences) land in an ``OutputCollector``. While the
consumer is slow, new outputs for a sequence are merged into the one pending record, so memory
per request is bounded by its token ids (at most ``max_tokens``), never by how long the client
stalls.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

from tokenline.engine.config import EngineConfig
from tokenline.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineOutput,
    EngineReady,
    EngineRequest,
    EngineStats,
    RequestFailed,
    Shutdown,
    StepOutputs,
)

logger = logging.getLogger("tokenline.engine")


class EngineDeadError(RuntimeError):
    """The engine process is gone; in-flight requests cannot complete."""


class EngineRequestError(ValueError):
    """The engine refused a request; ``param`` names the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _Failure:
    error: Exception


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


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, model_dir: Path, vocab_size: int | None = None) -> None:
        self.config = config
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.info: EngineReady | None = None
        self.error: str | None = None
        self.stats = EngineStats()
        self._collectors: dict[str, OutputCollector] = {}  # engine request id -> its collector
        self._live: set[OutputCollector] = set()  # collectors whose consumer has not let go yet
        self._aborting: set[str] = set()  # abort sent, final output not yet back
        self._ready = asyncio.Event()
        self._outbox: queue.Queue[object] = queue.Queue()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the engine process; returns at once (the model loads in the background)."""
        from tokenline.engine.core_process import run_engine_process

        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
        from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=run_engine_process,
            args=(self.config, str(self.model_dir), self.vocab_size, to_engine_r, from_engine_w),
            name="tokenline-engine",
            daemon=True,
        )
        self._process.start()
        # Close our copies of the child's ends so that its death shows up as EOF here.
        to_engine_r.close()
        from_engine_w.close()
        threading.Thread(target=self._read, args=(from_engine_r,), name="engine-reader", daemon=True).start()
        threading.Thread(target=self._write, args=(to_engine_w,), name="engine-writer", daemon=True).start()

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def alive(self) -> bool:
        return self.error is None and self._process is not None and self._process.is_alive()

    async def wait_ready(self, timeout: float | None = None) -> EngineReady:
        await asyncio.wait_for(self._ready.wait(), timeout)
        if self.info is None:
            raise EngineDeadError(self.error or "engine failed to start")
        return self.info

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._process is None:
            return
        self._stopping = True
        self._outbox.put(Shutdown())
        self._outbox.put(None)
        process = self._process
        await asyncio.to_thread(process.join, timeout)
        if process.is_alive():
            process.terminate()
            await asyncio.to_thread(process.join, 5.0)
        self._process = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # --- requests ------------------------------------------------------------------------------

    def add(self, requests: list[EngineRequest]) -> OutputCollector:
        """Send requests to the engine; their outputs arrive in the returned collector."""
        if not self.alive:
            raise EngineDeadError(self.error or "the engine is not running")
        collector = OutputCollector([r.request_id for r in requests])
        self._live.add(collector)
        for request in requests:
            self._collectors[request.request_id] = collector
            self._outbox.put(AddRequest(request))
        return collector

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (no-op for finished ones); the engine frees them before its next step and
        answers with their final output (the tokens actually produced), routed as usual."""
        for request_id in request_ids:
            if request_id in self._collectors and request_id not in self._aborting and self.alive:
                self._aborting.add(request_id)
                self._outbox.put(AbortRequest(request_id))

    def forget(self, collector: OutputCollector) -> None:
        """The consumer is done with a collector: stop counting its backlog, drop its routes."""
        self._live.discard(collector)
        for request_id in collector.request_ids:
            self._collectors.pop(request_id, None)
            self._aborting.discard(request_id)

    def backlog_tokens(self) -> int:
        """Tokens produced but not yet taken by their consumers, finished requests included."""
        return sum(c.backlog_tokens() for c in self._live)

    @property
    def num_inflight(self) -> int:
        return len(self._collectors)

    # --- the two I/O threads -------------------------------------------------------------------

    def _write(self, conn: object) -> None:
        # Pipe writes can block while the engine is mid-step; never let that stall the event loop.
        while (message := self._outbox.get()) is not None:
            try:
                conn.send(message)  # type: ignore[attr-defined]
            except (BrokenPipeError, OSError):
                return

    def _read(self, conn: object) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                message = conn.recv()  # type: ignore[attr-defined]
            except (EOFError, OSError):
                loop.call_soon_threadsafe(self._on_dead, "the engine process exited unexpectedly")
                return
            loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            self.stats = message.stats
            for output in message.outputs:
                collector = self._collectors.get(output.request_id)
                if collector is None:
                    continue  # aborted by us already
                collector.put(output)
                if output.finished:
                    del self._collectors[output.request_id]
                    self._aborting.discard(output.request_id)
        elif isinstance(message, EngineReady):
            self.info = message
            self._ready.set()
        elif isinstance(message, RequestFailed):
            collector = self._collectors.pop(message.request_id, None)
            if collector is not None:
                collector.fail(EngineRequestError(message.param, message.message))
        elif isinstance(message, EngineFailed):
            self._on_dead(message.error)

    def _on_dead(self, error: str) -> None:
        if self.error is None:
            self.error = "the engine has shut down" if self._stopping else error
            if not self._stopping:
                logger.error("engine process failed: %s", error)
        self._ready.set()
        failure = EngineDeadError(self.error)
        for collector in self._live:
            collector.fail(failure)
        self._collectors.clear()
        self._aborting.clear()

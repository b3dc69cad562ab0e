"""The ``EngineClient`` of an engine running in a child process of this one (the server's default).

The engine process is spawned (never forked) and talks to us over two pipes. The event loop writes
requests and aborts itself, on a non-blocking pipe (``PipeWriter``: the engine has a request the
moment it is handed over, never after a thread's wait for the GIL); a reader thread blocks on the
other pipe and hands what arrives to the loop. Each start makes a new process, pipes and reader
(a restart after a death calls ``start`` again); what the reader of an older, dead engine still
reports is dropped, so a late EOF can never kill its successor.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from pathlib import Path

from tokenline.engine.client import EngineClient, RestartPolicy
from tokenline.engine.config import EngineConfig
from tokenline.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineRequest,
    RequestFailed,
    Shutdown,
    StepOutputs,
)
from tokenline.engine.pipe_writer import PipeWriter

logger = logging.getLogger("tokenline.engine")


class _Exited:
    """The reader's note that the engine's pipe closed (the process exited)."""

class EngineProcessClient(EngineClient):
    def __init__(
        self, config: EngineConfig, model_dir: Path, vocab_size: int | None = None,
        restart: RestartPolicy | None = None,
    ) -> None:
        super().__init__(restart)
        self.config = config
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._writer: PipeWriter | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the engine process; returns at once (the model loads in the background)."""
        from tokenline.engine.core_process import run_engine_process

        self._loop = asyncio.get_running_loop()
        if self._writer is not None:
            self._writer.close()  # a previous (dead) engine's pipe
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
        process = self._process
        self._writer = PipeWriter(to_engine_w, self._loop)
        threading.Thread(target=self._read, args=(from_engine_r, process), name="engine-reader", daemon=True).start()

    async def _reap(self) -> None:
        process = self._process
        if process is not None:
            # A dead child stays a zombie until it is waited for; one that hangs gets killed.
            await asyncio.to_thread(process.join, 5.0)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
            logger.info("engine process %s reaped (exit code %s)", process.pid, process.exitcode)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()  # no restart while we stop
        if self._process is None:
            return
        if self._writer is not None:
            self._writer.send(Shutdown())
            self._writer.close()  # once the message is out
        process = self._process
        await asyncio.to_thread(process.join, timeout)
        if process.is_alive():
            process.terminate()
            await asyncio.to_thread(process.join, 5.0)
        self._on_dead("the engine has shut down")  # whatever still waits hears it now
        self._process = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # --- the transport -------------------------------------------------------------------------

    def _submit(self, request: EngineRequest) -> None:
        self._send(AddRequest(request))

    def _cancel(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def _send(self, message: object) -> None:
        if self._writer is None:
            raise RuntimeError("the engine process was never started")
        self._writer.send(message)

    def _transport_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _read(self, conn: object, process: multiprocessing.process.BaseProcess) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                message = conn.recv()  # type: ignore[attr-defined]
            except (EOFError, OSError):
                loop.call_soon_threadsafe(self._dispatch, process, _Exited())
                return
            loop.call_soon_threadsafe(self._dispatch, process, message)

    def _dispatch(self, process: multiprocessing.process.BaseProcess, message: object) -> None:
        if process is not self._process:
            return  # from an engine that died and was replaced
        if isinstance(message, _Exited):
            process.join(0)  # reap at once if it is gone (no zombie), without blocking
            self._on_dead(f"the engine process exited unexpectedly (exit code {process.exitcode})")
        elif isinstance(message, StepOutputs):
            self._deliver(message)
        elif isinstance(message, EngineReady):
            self._set_ready(message)
        elif isinstance(message, RequestFailed):
            self._reject(message.request_id, message.param, message.message)
        elif isinstance(message, EngineFailed):
            self._on_dead(message.error)

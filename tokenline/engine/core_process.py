"""The engine core in its own process: the model loop never shares a GIL with HTTP.

The process reads typed messages (add, abort, shutdown) from one pipe between steps and writes
one ``StepOutputs`` per step to the other. When it has no work it blocks on its input, so an
idle server costs no CPU.
"""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from tokenline.engine.config import EngineConfig, build_engine_core
from tokenline.engine.engine_core import EngineCore, RequestRejected
from tokenline.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    RequestFailed,
    Shutdown,
    StepOutputs,
)

logger = logging.getLogger("tokenline.engine")


def run_engine_process(
    config: EngineConfig, model_dir: str, vocab_size: int | None, inbox: Connection, outbox: Connection
) -> None:
    """Entry point of the engine process (started with the ``spawn`` method)."""
    try:
        core = build_engine_core(config, Path(model_dir), vocab_size)
    except Exception as exc:  # noqa: BLE001 - any load failure must reach the API process
        outbox.send(EngineFailed(f"engine failed to start: {exc!r}"))
        return
    runner = core.runner
    outbox.send(
        EngineReady(
            max_model_len=core.max_model_len,
            num_kv_blocks=core.kv_cache.pool.num_blocks,
            block_size=core.kv_cache.block_size,
            dtype=str(getattr(runner, "dtype", "")).removeprefix("torch."),
        )
    )
    try:
        _loop(core, inbox, outbox)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the API process went away: nothing left to serve
    except Exception:  # noqa: BLE001
        outbox.send(EngineFailed(f"engine crashed:\n{traceback.format_exc()}"))
        raise


def _loop(core: EngineCore, inbox: Connection, outbox: Connection) -> None:
    while True:
        # Block while idle; between steps take whatever has arrived without waiting.
        timeout = 0.0 if core.has_unfinished_requests() else None
        aborted = []
        while inbox.poll(timeout):
            message = inbox.recv()
            timeout = 0.0
            if isinstance(message, AddRequest):
                try:
                    core.add_request(message.request)
                except (RequestRejected, ValueError) as exc:
                    param = getattr(exc, "param", "prompt")
                    outbox.send(RequestFailed(message.request.request_id, param, str(exc)))
            elif isinstance(message, AbortRequest):
                output = core.abort_request(message.request_id)
                if output is not None:
                    aborted.append(output)
            elif isinstance(message, Shutdown):
                return
        outputs = aborted + core.step()
        if outputs or aborted:
            outbox.send(StepOutputs(outputs, core.stats()))
        elif not core.has_unfinished_requests():
            outbox.send(StepOutputs([], core.stats()))  # idle: publish the settled numbers

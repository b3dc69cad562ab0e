"""The engine core in its own process: the model loop never shares a GIL with HTTP.

The process reads typed messages (add, abort, shutdown) from one pipe between steps and writes
one ``StepOutputs`` per step to the other, with the step's record and KV cache events. When it
has no work it blocks on its input, so an idle server costs no CPU.

With ``EngineConfig.kv_events_endpoint`` the KV events also go out on a ZMQ PUB socket (one
``EventBatch`` per step that had events) for routers in other processes.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from tokenline.engine.config import EngineConfig

from tokenline.engine.factory import build_engine_core
from tokenline.engine.engine_core import EngineCore, RequestRejected
from tokenline.engine.kv_events import EventBatch
from tokenline.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    RequestFailed,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
)

if TYPE_CHECKING:
    from tokenline.engine.kv_events_zmq import ZmqEventPublisher

logger = logging.getLogger("tokenline.engine")


def run_engine_process(
    config: EngineConfig, model_dir: str, vocab_size: int | None, inbox: Connection, outbox: Connection
) -> None:
    """Entry point of the engine process (started with the ``spawn`` method)."""
    publisher = None
    if config.num_threads and config.core_factory is None:  # a simulated engine has no torch to size
        import torch  # the engine process owns torch; threads are set before any op runs

        torch.set_num_threads(config.num_threads)
    try:
        # A port already taken fails the start visibly, and before the model's long load.
        publisher = _start_publisher(config)
        core = build_engine_core(config, Path(model_dir), vocab_size)
    except Exception as exc:  # noqa: BLE001 - any load failure must reach the API process
        if publisher is not None:
            publisher.close()
        outbox.send(EngineFailed(f"engine failed to start: {exc!r}"))
        return
    runner = core.runner
    # The loaded model and engine live as long as the process: out of the collector's sight, the
    # full collections the step loop's garbage triggers no longer walk them (as vLLM freezes its heap).
    gc.collect()
    gc.freeze()
    outbox.send(
        EngineReady(
            max_model_len=core.max_model_len,
            num_kv_blocks=core.kv_cache.pool.num_blocks,
            block_size=core.kv_cache.block_size,
            dtype=str(getattr(runner, "dtype", "")).removeprefix("torch."),
        )
    )
    try:
        _loop(core, inbox, outbox, publisher)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the API process went away: nothing left to serve
    except Exception:  # noqa: BLE001
        outbox.send(EngineFailed(f"engine crashed:\n{traceback.format_exc()}"))
        raise
    finally:
        if publisher is not None:
            publisher.close()


def _start_publisher(config: EngineConfig) -> ZmqEventPublisher | None:
    if config.kv_events_endpoint is None:
        return None
    from tokenline.engine.kv_events_zmq import ZmqEventPublisher  # only its users import pyzmq

    return ZmqEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic,
                             data_parallel_rank=config.data_parallel_rank)


def _loop(
    core: EngineCore, inbox: Connection, outbox: Connection, publisher: ZmqEventPublisher | None = None
) -> None:
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
                    logger.info("refused %s (request id %s): %s", message.request.request_id,
                                message.request.client_request_id, exc)
                    outbox.send(RequestFailed(message.request.request_id, param, str(exc)))
            elif isinstance(message, AbortRequest):
                output = core.abort_request(message.request_id)
                if output is not None:
                    aborted.append(output)
            elif isinstance(message, ResetPrefixCache):
                core.reset_prefix_cache()
            elif isinstance(message, Shutdown):
                return
        outputs = aborted + core.step()
        for failed in core.take_failed_requests():  # grammars that did not compile
            outbox.send(failed)
        records = core.take_step_records()
        events = core.take_kv_events()
        if events and publisher is not None:
            # Wall-clock ts, as vLLM sends: consumers compare batches across machines.
            publisher.publish(EventBatch(time.time(), events))
        # Send after every step that ran (a prefill chunk has no outputs but has a record), and
        # once when idle to publish the settled numbers.
        if outputs or records or events or not core.has_unfinished_requests():
            outbox.send(StepOutputs(outputs, core.stats(), events, records))

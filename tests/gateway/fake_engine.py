"""An ``EngineClient`` with no model behind it: each request is answered with a fixed reply, one
token per event-loop tick. It exercises the real routing (collectors, aborts, stats) of the base
class, so the gateway and the processor in front of it run exactly as in the server."""

from __future__ import annotations

import asyncio
import time

from tokenline.engine.client import EngineClient
from tokenline.engine.messages import (
    EngineOutput,
    EngineReady,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestTimings,
    StepOutputs,
)


class FakeEngineClient(EngineClient):
    def __init__(self, reply_ids: list[int], max_model_len: int = 2048) -> None:
        super().__init__()
        self.reply_ids = reply_ids
        self.max_model_len = max_model_len
        self.requests: list[EngineRequest] = []  # every request the processor sent, in order
        self.num_steps = 0
        self._running: dict[str, int] = {}  # request id -> tokens produced so far
        self._started = False

    def start(self) -> None:
        self._started = True
        self._set_ready(EngineReady(self.max_model_len, num_kv_blocks=64, block_size=16, dtype="none"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._started = False

    def _transport_alive(self) -> bool:
        return self._started

    def _submit(self, request: EngineRequest) -> None:
        self.requests.append(request)
        self._running[request.request_id] = 0
        asyncio.get_running_loop().create_task(self._generate(request))

    def _cancel(self, request_id: str) -> None:
        produced = self._running.pop(request_id, None)
        if produced is not None:
            request = next(r for r in self.requests if r.request_id == request_id)
            self._step([self._output(request, [], produced, FinishReason.ABORT)])

    async def _generate(self, request: EngineRequest) -> None:
        limit = min(request.sampling.max_tokens or len(self.reply_ids), len(self.reply_ids))
        for i in range(limit):
            await asyncio.sleep(0.001)
            if request.request_id not in self._running:
                return  # aborted
            self._running[request.request_id] = i + 1
            last = i + 1 == limit
            finish = None
            if last:
                finish = FinishReason.LENGTH if limit == request.sampling.max_tokens else FinishReason.STOP
                del self._running[request.request_id]
            self._step([self._output(request, [self.reply_ids[i]], i + 1, finish)])

    def _output(
        self, request: EngineRequest, new: list[int], produced: int, finish: FinishReason | None
    ) -> EngineOutput:
        now = time.monotonic()
        timings = RequestTimings(request.arrival_time, request.arrival_time, now, now, now, produced, 0)
        return EngineOutput(
            request.request_id, new, finish_reason=finish, num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=produced, timings=timings if finish is not None else None,
        )

    def _step(self, outputs: list[EngineOutput]) -> None:
        self.num_steps += 1
        stats = EngineStats(num_running=len(self._running), num_steps=self.num_steps, kv_cache_usage=0.25)
        self._deliver(StepOutputs(outputs, stats))

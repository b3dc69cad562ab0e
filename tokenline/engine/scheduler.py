"""Continuous batching with one rule, as in vLLM v1.

There is no prefill phase and no decode phase: every request has a number of computed tokens that
must catch up with its number of tokens, within a per-step token budget and a sequence cap.
Running requests go first, then waiting ones. A long prompt therefore prefills in chunks beside
ongoing decodes, and requests join and leave the batch at every step. When blocks run out, the
lowest-priority (latest) running request is preempted: its blocks are freed and it is recomputed
later.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from tokenline.engine.batch import SampledToken, ScheduledBatch, ScheduledSeq
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import FinishReason
from tokenline.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


@dataclass
class StepResult:
    """What one step did to one request: the token it gained, and whether that finished it."""

    request: Request
    token: SampledToken | None
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- requests in and out -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks; None if it is not here."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request id -> tokens computed this step
        preempted = False

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = max(self.running, key=Request.sort_key)
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                scheduled[request.request_id] = num_new
                budget -= num_new

        # Admitting new work in a step that had to preempt would only thrash the cache.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached_blocks = self.kv_cache.find_cached_prefix(request)
            num_cached = len(cached_blocks) * self.kv_cache.block_size
            # Admit only if the whole known sequence (plus the next token) fits beside current
            # work, so a chunked prefill is never stranded half way; otherwise it queues.
            if not self.kv_cache.can_fit(request, request.num_tokens + 1, cached_blocks):
                break
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(request, num_new, cached_blocks):
                break
            self.waiting.pop(0)
            self.kv_cache.record_admission(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new

        return ScheduledBatch([self._scheduled_seq(self.requests[rid], n) for rid, n in scheduled.items()])

    def update(self, batch: ScheduledBatch, sampled: dict[str, SampledToken]) -> list[StepResult]:
        """Advance each scheduled request by what the runner computed and sampled."""
        results = []
        now = time.monotonic()
        shared = len(batch.seqs) > 1
        for seq in batch.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.timings.num_steps += 1
            request.timings.num_shared_steps += shared
            request.num_computed_tokens += seq.num_tokens
            self.kv_cache.cache_full_blocks(request)
            if not seq.sample:
                continue  # a prefill chunk that does not reach the end yet
            token = sampled[seq.request_id]
            request.token_ids.append(token.token_id)
            if request.timings.first_token is None:
                request.timings.first_token = now
            request.timings.last_token = now
            reason = self._check_stop(request, token.token_id)
            if reason is not None:
                self._finish(request, reason)
            results.append(StepResult(request, token, reason is not None))
        return results

    # --- internals -----------------------------------------------------------------------------

    def _scheduled_seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new
        sample = end == request.num_tokens
        params = request.sampling
        banned: tuple[int, ...] = ()
        if sample and request.num_output_tokens < params.min_tokens:
            banned = (*request.eos_token_ids, *params.stop_token_ids)
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.token_ids[start:end],
            start_pos=start,
            block_table=self.kv_cache.block_table(request.request_id),
            sample=sample,
            sampling=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids if sample else (),
            generator=request.generator,
            banned_token_ids=banned,
            state_slot=self.kv_cache.state_slot(request.request_id),
        )

    def _check_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return FinishReason.STOP
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timings.finished = time.monotonic()
        del self.requests[request.request_id]

    def check_integrity(self) -> None:
        """Raise if the queues or the block books are inconsistent (cheap; run when idle)."""
        self.kv_cache.check_integrity()
        in_queues = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        if in_queues != set(self.requests) or len(self.running) + len(self.waiting) != len(self.requests):
            raise AssertionError("scheduler queues disagree with its request table")
        holders = set(self.kv_cache.tables)
        if not holders <= {r.request_id for r in self.running}:
            raise AssertionError(f"requests hold blocks while not running: {holders - set(in_queues)}")

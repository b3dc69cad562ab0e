"""The engine step loop: schedule, run the model, fold the sampled tokens back, report.

One ``EngineCore`` owns the scheduler, the KV cache books and a runner. It is synchronous and
single-threaded; the offline ``LLM`` drives it directly and the server runs it in its own process.

Besides its outputs, every step leaves a ``StepRecord`` and (when enabled) the KV cache events
of the pool; callers drain them with ``take_step_records`` and ``take_kv_events``. All times come
from one injectable clock, so a simulator can run this loop on simulated time.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from tokenline.engine.context_window import completion_overflow, prompt_overflow
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.kv_events import KVCacheEvent
from tokenline.engine.messages import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestFailed,
    StepRecord,
    TokenLogprobs,
)
from tokenline.engine.request import Request
from tokenline.engine.scheduler import Scheduler, SchedulerConfig
from tokenline.model.batch import Runner, SampledToken, ScheduledBatch
from tokenline.spec_decode.mtp_proposer import MtpProposer
from tokenline.spec_decode.ngram_proposer import NgramProposer
from tokenline.spec_decode.suffix_proposer import SuffixProposer
from tokenline.structured_output.grammar import GrammarCompiler

MAX_STEP_RECORDS = 10_000  # kept for a caller that drains them rarely (or never): the newest win
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0

logger = logging.getLogger("tokenline.engine")


class RequestRejected(ValueError):
    """A request the engine can never serve (too long for the context or the KV pool)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class EngineCore:
    def __init__(
        self,
        runner: Runner,
        kv_cache: KVCacheManager,
        scheduler_config: SchedulerConfig,
        eos_token_ids: Iterable[int] = (),
        device: str = "cpu",
        check_integrity_every_step: bool = False,
        proposer: NgramProposer | SuffixProposer | MtpProposer | None = None,
        clock: Callable[[], float] = time.monotonic,
        grammar_compiler: GrammarCompiler | None = None,
        grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.clock = clock
        self.scheduler = Scheduler(scheduler_config, kv_cache, proposer, clock)
        self.max_model_len = scheduler_config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.check_integrity_every_step = check_integrity_every_step
        self.num_steps = 0
        self._step_records: deque[StepRecord] = deque(maxlen=MAX_STEP_RECORDS)
        # Structured output: compiled off the step loop; requests wait in the queue meanwhile.
        self.grammar_compiler = grammar_compiler
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self._compiling: dict[str, Request] = {}
        self._failed: list[RequestFailed] = []

    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request, or raise ``RequestRejected`` if it could never complete."""
        # The request processor has checked the request already (frontend/processor.py); this is
        # for requests handed to the engine directly, with the same check and messages.
        num_prompt = len(engine_request.prompt_token_ids)
        if num_prompt == 0:
            raise RequestRejected("prompt", "the prompt is empty")
        overflow = prompt_overflow(num_prompt, self.max_model_len)
        if overflow is not None:
            raise RequestRejected("prompt", overflow)
        requested = engine_request.sampling.max_tokens
        max_tokens = self.max_model_len - num_prompt if requested is None else requested
        overflow = completion_overflow(num_prompt, max_tokens, self.max_model_len)
        if overflow is not None:
            raise RequestRejected("max_tokens", overflow)
        # What only the engine knows: the pool.
        pool_tokens = self.kv_cache.pool.num_blocks * self.kv_cache.block_size
        # Sliding-window groups hold a window's blocks, not the whole sequence's (kv_cache_manager.py).
        needed = self.kv_cache.blocks_for_sequence(num_prompt + max_tokens)
        if needed > self.kv_cache.pool.num_blocks:
            size = (f"{needed} blocks of its KV cache groups, the pool has {self.kv_cache.pool.num_blocks}"
                    if self.kv_cache.grouped else f"{pool_tokens} tokens")
            raise RequestRejected(
                "max_tokens",
                f"prompt + max_tokens ({num_prompt + max_tokens} tokens) exceeds the whole KV cache "
                f"({size}); raise --kv-cache-memory or lower max_tokens",
            )
        spec = engine_request.sampling.structured_outputs
        if spec is not None and self.grammar_compiler is None:
            raise RequestRejected("structured_outputs", "this engine has no tokenizer.json to build grammars with")
        request = Request(engine_request, max_tokens, self.eos_token_ids, self.device)
        self.scheduler.add(request)
        if spec is not None:
            assert self.grammar_compiler is not None
            request.grammar_future = self.grammar_compiler.submit(spec, engine_request.tenant)
            request.grammar_submitted = self.clock()
            self._compiling[request.request_id] = request
            self._poll_grammars()  # a cached grammar is ready at once

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Stop a request now; its output reports the tokens it actually produced."""
        self._compiling.pop(request_id, None)
        request = self.scheduler.abort(request_id)
        return None if request is None else self._output(request, [], None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def take_failed_requests(self) -> list[RequestFailed]:
        """Requests removed since the last call because their grammar failed to compile (or took
        longer than the bound); they produced no tokens. The engine process sends each on."""
        failed, self._failed = self._failed, []
        return failed

    def step(self) -> list[EngineOutput]:
        start = self.clock()
        preemptions_before = self.scheduler.num_preemptions
        if self._compiling:
            self._poll_grammars()
        batch = self.scheduler.schedule()
        if not batch:
            if not self.scheduler.has_unfinished():
                self.scheduler.check_integrity()  # idle: cheap, catches any leak at once
            elif self._compiling:
                # Only compiling requests are left: wait a little for one rather than spin.
                futures = [r.grammar_future for r in self._compiling.values() if r.grammar_future is not None]
                concurrent.futures.wait(futures, timeout=0.01, return_when=concurrent.futures.FIRST_COMPLETED)
            return []
        record = self._start_record(batch, start)  # before update() moves the requests on
        sampled = self.runner.execute(batch)
        results = self.scheduler.update(batch, sampled)
        self.num_steps += 1
        self._finish_record(record, self.scheduler.num_preemptions - preemptions_before)
        if self.check_integrity_every_step:
            self.scheduler.check_integrity()
        return [self._output(r.request, r.new_token_ids, r.token) for r in results if r.token is not None or r.finished]

    def _poll_grammars(self) -> None:
        """Hand finished compilations to their requests; fail those whose compilation failed or
        ran past the bound (its thread finishes in the background; the request does not wait)."""
        now = self.clock()
        for request_id, request in list(self._compiling.items()):
            future = request.grammar_future
            if request.finished or future is None:  # aborted meanwhile
                del self._compiling[request_id]
                continue
            if future.done():
                del self._compiling[request_id]
                error = future.exception()
                if error is None:
                    spec = request.sampling.structured_outputs
                    assert spec is not None
                    request.grammar = future.result().new_state(spec.start_after_token_id)
                    request.grammar_future = None
                    continue
                param = getattr(error, "param", "structured_outputs")
                self._fail(request, param, str(error))
            elif now - request.grammar_submitted > self.grammar_compile_timeout_s:
                del self._compiling[request_id]
                self._fail(
                    request,
                    "structured_outputs",
                    f"the grammar did not compile within {self.grammar_compile_timeout_s:g} s; simplify the schema",
                )

    def _fail(self, request: Request, param: str, message: str) -> None:
        logger.info("request %s failed: %s", request.request_id, message)
        self.scheduler.abort(request.request_id)
        self._failed.append(RequestFailed(request.request_id, param, message))

    def take_step_records(self) -> list[StepRecord]:
        """The records of the steps run since the last call (at most ``MAX_STEP_RECORDS``)."""
        records = list(self._step_records)
        self._step_records.clear()
        return records

    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call, in order; empty unless the pool records them."""
        return self.kv_cache.pool.take_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks); emits AllBlocksCleared."""
        self.kv_cache.reset_prefix_cache()

    def stats(self) -> EngineStats:
        prefix = self.kv_cache.prefix_stats
        spec = self.scheduler.spec_stats
        stats = EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage(),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_steps=self.num_steps,
            num_kv_blocks=self.kv_cache.pool.num_blocks,
            num_free_kv_blocks=self.kv_cache.pool.num_free_blocks,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            prefix_cache_kv_matched=prefix.kv_matched,
        )
        checkpoints = self.kv_cache.checkpoints
        if checkpoints is not None:
            stats.num_state_checkpoints = checkpoints.num_slots
            stats.num_state_checkpoints_used = checkpoints.num_used
            stats.state_checkpoints_saved = checkpoints.stats.saved
            stats.state_checkpoint_hits = checkpoints.stats.hits
        if self.grammar_compiler is not None:
            times = self.grammar_compiler.compile_seconds
            stats.grammar_compile_count = len(times)
            stats.grammar_compile_seconds_sum = sum(times)
            stats.grammar_cache_hits = self.grammar_compiler.num_cache_hits
            stats.grammar_cache_bytes = self.grammar_compiler.num_cached_bytes
            stats.grammar_cache_entries = self.grammar_compiler.num_cached
            stats.grammar_cache_evictions = self.grammar_compiler.num_evictions
        return stats

    def _start_record(self, batch: ScheduledBatch, start: float) -> StepRecord:
        prefill = decode = drafts = context = pairs = 0
        for seq in batch.seqs:
            request = self.scheduler.requests[seq.request_id]
            context += seq.start_pos + len(seq.token_ids)
            # Decoding: computing just the newest token, an output one (plus drafts beside it).
            if seq.start_pos == request.num_tokens - 1 >= request.num_prompt_tokens:
                decode += len(seq.token_ids)
                drafts += len(seq.draft_token_ids)
            else:
                prefill += len(seq.token_ids)
                pairs += seq.attention_pairs
        return StepRecord(
            step=self.num_steps, start=start, duration=0.0, num_prefill_tokens=prefill, num_decode_tokens=decode,
            num_seqs=len(batch.seqs), num_running=0, num_waiting=0, num_kv_blocks_used=0,
            num_kv_blocks=self.kv_cache.pool.num_blocks, num_state_slots=self.kv_cache.num_state_slots,
            num_draft_tokens=drafts, num_context_tokens=context, num_prefill_attention_pairs=pairs,
        )

    def _finish_record(self, record: StepRecord, num_preemptions: int) -> None:
        record.duration = self.clock() - record.start
        record.num_running = self.scheduler.num_running
        record.num_waiting = self.scheduler.num_waiting
        record.num_kv_blocks_used = self.kv_cache.pool.num_used_blocks
        record.num_state_slots_used = self.kv_cache.num_state_slots_used
        record.num_preemptions = num_preemptions
        self._step_records.append(record)

    def _output(self, request: Request, new_token_ids: list[int], token: SampledToken | None) -> EngineOutput:
        finish: FinishReason | None = request.finish_reason
        logprobs = None
        if token is not None and token.logprobs is not None:
            # Tokens the grammar forced after the sampled one had no choice: probability 1 under the
            # mask. (Requests with logprobs never draft, so every further token here is forced.)
            forced = [TokenLogprobs(0.0, [(t, 0.0)] if token.logprobs.top else []) for t in new_token_ids[1:]]
            logprobs = [token.logprobs, *forced]
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            prompt_logprobs=request.take_prompt_logprobs(),
            finish_reason=finish,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_output_tokens=request.num_output_tokens,
            timings=request.timings if finish is not None else None,
        )

"""Continuous batching with one rule, as in vLLM v1.

There is no prefill phase and no decode phase: every request has a number of computed tokens that
must catch up with its number of tokens, within a per-step token budget and a sequence cap.
Running requests go first, then waiting ones. A long prompt therefore prefills in chunks beside
ongoing decodes, and requests join and leave the batch at every step. When blocks run out, the
lowest-priority (latest) running request is preempted: its blocks are freed and it is recomputed
later.

Speculative decoding fits the same rule: a decoding request may compute its last token plus a few
drafted guesses in one step; the runner returns the model's own token at every position, and the
request keeps the drafts the model agrees with plus one token of its own.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenline.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import FinishReason
from tokenline.engine.request import Request, RequestStatus
from tokenline.model.batch import SampledToken, ScheduledBatch, ScheduledSeq, num_accepted_drafts
from tokenline.spec_decode.mtp_proposer import MtpProposer
from tokenline.spec_decode.ngram_proposer import NgramProposer
from tokenline.spec_decode.suffix_proposer import SuffixProposer
from tokenline.structured_output.grammar import fill_bitmasks

logger = logging.getLogger("tokenline.engine")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    # The most tokens a step may have for the model's one-call decode layers to take it (the
    # model's fused_step_tokens(); 0: it has none). Drafts stay below it at a large batch.
    fused_step_tokens: int = 0


# From this many decoding sequences, drafts only take the rows a step that fits the one-call
# decode layers has left below their cap. Such a step computes more than it reads, so a row costs
# its share of the step, and past the cap every row pays the per-operator path (1.3x a step of 32
# here): a c=32 step with ~40 drafts cost more than its accepted drafts won (suffix 0.83x plain).
# Below this, a step is memory-bound and drafts pay even off the fused path (c=1: 2x).
DRAFTS_WITHIN_FUSED_MIN_DECODES = 8


@dataclass
class StepResult:
    """What one step did to one request: the tokens it gained, and whether that finished it."""

    request: Request
    token: SampledToken | None
    finished: bool
    new_token_ids: list[int]  # token.token_id, or with speculation the accepted drafts + one


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # steps in which a request verified drafts
    num_draft_tokens: int = 0  # tokens drafted
    num_accepted_tokens: int = 0  # drafted tokens the model agreed with


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        proposer: NgramProposer | SuffixProposer | MtpProposer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        # Every timestamp the scheduler writes comes from here, so a simulator can drive this very
        # scheduler on simulated time.
        self.clock = clock
        # Hybrid models speculate too: the runner keeps their recurrent state after the accepted
        # drafts only (model/gated_deltanet.py, PendingStates), by the same acceptance rule.
        self.proposer = proposer
        self.spec_stats = SpecDecodeStats()
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
        drafts: dict[str, list[int]] = {}  # request id -> draft tokens among those
        preempted = False
        draft_rows: int | None = None  # drafts this step may still add (None: the budget's)
        if self.proposer is not None:
            num_decoding = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
            if isinstance(self.proposer, SuffixProposer):
                # Its drafts get more cautious as the batch grows (a rejected row costs more there).
                self.proposer.begin_step(num_decoding)
            if DRAFTS_WITHIN_FUSED_MIN_DECODES <= num_decoding <= self.config.fused_step_tokens:
                draft_rows = self.config.fused_step_tokens - num_decoding

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            decoding = request.num_tokens - request.num_computed_tokens == 1  # only the last token is new
            guess = self._propose(request, budget, draft_rows) if decoding else []
            # Drafts only take free blocks: speculation never preempts anyone.
            if guess and self.kv_cache.allocate_slots(request, 1 + len(guess)):
                drafts[request.request_id] = guess
                num_new += len(guess)
                if draft_rows is not None:
                    draft_rows -= len(guess)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = max(self.running, key=Request.sort_key)
                budget += scheduled.pop(victim.request_id, 0)
                drafts.pop(victim.request_id, None)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                scheduled[request.request_id] = num_new
                budget -= num_new

        # Admitting new work in a step that had to preempt would only thrash the cache.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            # A request whose grammar is still compiling waits without holding up those behind it.
            request = next((r for r in self.waiting if not r.waiting_for_grammar), None)
            if request is None:
                break
            cached_blocks = self.kv_cache.find_cached_prefix(request)
            num_cached = len(cached_blocks) * self.kv_cache.block_size
            # Admit only if the whole known sequence (plus the next token) fits beside current
            # work, so a chunked prefill is never stranded half way; otherwise it queues.
            if not self.kv_cache.can_fit(request, request.num_tokens + 1, cached_blocks):
                break
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(request, num_new, cached_blocks):
                break
            self.waiting.remove(request)
            self.kv_cache.record_admission(request.num_tokens, num_cached, request.kv_matched_tokens)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = self.clock()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new

        if isinstance(self.proposer, MtpProposer):
            # The MTP head drafts at positions past this step's tokens, writing its own KV there
            # (model/mtp_drafter.py): room for them from blocks still free, never by preempting.
            for rid, n in scheduled.items():
                request = self.requests[rid]
                if request.num_computed_tokens + n >= request.num_tokens:
                    self.kv_cache.allocate_slots(request, n + self.proposer.num_speculative_tokens)
        # Hybrid models' state checkpoints are planned once the batch is final (no preemption can
        # take a planned save's sequence out of it any more).
        batch = ScheduledBatch(
            [self._scheduled_seq(self.requests[rid], n, drafts.get(rid, [])) for rid, n in scheduled.items()]
        )
        self._attach_grammar_bitmasks(batch)
        return batch

    def update(self, batch: ScheduledBatch, sampled: dict[str, SampledToken]) -> list[StepResult]:
        """Advance each scheduled request by what the runner computed and sampled."""
        results = []
        now = self.clock()
        shared = len(batch.seqs) > 1
        self.kv_cache.commit_checkpoints()  # the runner wrote them
        for seq in batch.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.timings.num_steps += 1
            request.timings.num_shared_steps += shared
            scores = batch.prompt_logprobs.get(seq.request_id)
            if scores is not None:
                request.add_prompt_logprobs(seq.start_pos, scores)
            if not seq.sample:
                request.num_computed_tokens += seq.num_tokens
                self.kv_cache.cache_full_blocks(request)
                if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                    # Only the prompt was asked for (to score it): done, nothing generated.
                    self._finish(request, FinishReason.LENGTH)
                    results.append(StepResult(request, None, True, []))
                continue  # a prefill chunk that does not reach the end yet
            token = sampled[seq.request_id]
            new_token_ids = self._accept(seq.draft_token_ids, token)
            if isinstance(self.proposer, SuffixProposer):
                self.proposer.record(request.request_id, len(seq.draft_token_ids), len(new_token_ids) - 1)
            if isinstance(self.proposer, MtpProposer) and token.next_draft_token_ids:
                # Drafted by the runner to follow the tokens just accepted (before any stop cuts them).
                known = seq.start_pos + seq.num_tokens - len(seq.draft_token_ids)
                self.proposer.observe(request.request_id, known + len(new_token_ids), token.next_draft_token_ids)
            reason = None
            for i, token_id in enumerate(new_token_ids):
                request.token_ids.append(token_id)
                reason = self._check_stop(request, token_id)
                if request.grammar is not None and reason in (None, FinishReason.LENGTH):
                    reason = self._advance_grammar(request, token_id) or reason
                if reason is not None:
                    del new_token_ids[i + 1 :]  # tokens after a stop are never shown
                    break
            # Valid KV now covers the last token and the drafts kept, i.e. all tokens but the newest;
            # the rejected drafts' slots hold garbage that later tokens overwrite.
            request.num_computed_tokens += seq.num_tokens - len(seq.draft_token_ids) + len(new_token_ids) - 1
            self.kv_cache.cache_full_blocks(request)
            if reason is None and request.grammar is not None:
                reason = self._fast_forward(request, new_token_ids)
            if request.timings.first_token is None:
                request.timings.first_token = now
            request.timings.last_token = now
            if reason is not None:
                self._finish(request, reason)
            results.append(StepResult(request, token, reason is not None, new_token_ids))
        return results

    # --- speculative decoding ------------------------------------------------------------------

    def _propose(self, request: Request, budget: int, draft_rows: int | None = None) -> list[int]:
        """Draft tokens for a decoding request, or none when it must not speculate; at most
        ``draft_rows`` of them when that is given."""
        if self.proposer is None or draft_rows == 0:
            return []
        params = request.sampling
        # Only plain greedy requests: their verification is an exact comparison with the argmax,
        # and nothing else (logprobs, penalties, biases, banned ids) depends on the step's position.
        if (
            not params.greedy
            or params.logprobs is not None
            or params.logit_bias
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty not in (None, 1.0)
            or request.num_output_tokens < params.min_tokens
            or (request.grammar is not None and not request.grammar.active)
        ):
            return []
        # Room for the drafts and the model's own token after them, within every limit.
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
            budget if draft_rows is None else draft_rows,
        )
        drafts = self.proposer.propose(request.request_id, request.token_ids, room)
        if request.grammar is not None and drafts:
            # Only drafts the grammar accepts can be verified (the masked argmax never picks others).
            drafts = drafts[: request.grammar.num_valid(drafts)]
        return drafts

    def _accept(self, drafts: Sequence[int], token: SampledToken) -> list[int]:
        """The drafts the model agrees with, then the model's own token after the last of them."""
        targets = [token.token_id, *token.draft_targets]
        accepted = num_accepted_drafts(drafts, token)
        if drafts:
            self.spec_stats.num_drafts += 1
            self.spec_stats.num_draft_tokens += len(drafts)
            self.spec_stats.num_accepted_tokens += accepted
        return targets[: accepted + 1]

    # --- structured output -------------------------------------------------------------------

    def _attach_grammar_bitmasks(self, batch: ScheduledBatch) -> None:
        """One bitmask for the step's constrained rows (1 + drafts per sequence), filled together;
        each sequence gets its slice."""
        constrained = []
        num_rows = 0
        for seq in batch.seqs:
            grammar = self.requests[seq.request_id].grammar
            if seq.sample and grammar is not None and grammar.active:
                constrained.append((seq, grammar, num_rows))
                num_rows += 1 + len(seq.draft_token_ids)
        if not constrained:
            return
        bitmask = np.zeros((num_rows, constrained[0][1].words), dtype=np.int32)
        fill_bitmasks(bitmask, [(grammar, row, seq.draft_token_ids) for seq, grammar, row in constrained])
        for seq, _, row in constrained:
            seq.grammar_bitmask = bitmask[row : row + 1 + len(seq.draft_token_ids)]

    def _fast_forward(self, request: Request, new_token_ids: list[int]) -> FinishReason | None:
        """Append the tokens the grammar forces next, unsampled: the next step computes their KV
        in one chunk (they are just tokens not yet computed) and samples after the last of them."""
        assert request.grammar is not None
        reason = None
        room = min(request.max_tokens - request.num_output_tokens, self.config.max_model_len - request.num_tokens)
        for token_id in request.grammar.forced_tokens()[: max(0, room)]:
            request.token_ids.append(token_id)
            new_token_ids.append(token_id)
            reason = self._check_stop(request, token_id)
            if reason in (None, FinishReason.LENGTH):
                reason = self._advance_grammar(request, token_id) or reason
            if reason is not None:
                break
        return reason

    def _advance_grammar(self, request: Request, token_id: int) -> FinishReason | None:
        """Feed an accepted token to the request's matcher: STOP once the grammar is complete and
        admits nothing more, ERROR if it rejects the token (only an all-forbidden row can do that)."""
        grammar = request.grammar
        assert grammar is not None
        if not grammar.accept((token_id,)):
            logger.warning("request %s: token %d breaks its grammar: %s", request.request_id, token_id, grammar.error)
            return FinishReason.ERROR
        return FinishReason.STOP if grammar.terminated else None

    # --- internals -----------------------------------------------------------------------------

    def _scheduled_seq(self, request: Request, num_new: int, drafts: list[int]) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new - len(drafts)
        sample = end == request.num_tokens and request.max_tokens > 0
        params = request.sampling
        banned: tuple[int, ...] = ()
        if sample and request.num_output_tokens < params.min_tokens:
            banned = (*request.eos_token_ids, *params.stop_token_ids)
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.token_ids[start:end] + drafts,
            start_pos=start,
            block_table=self.kv_cache.block_table(request.request_id),
            group_block_tables=self.kv_cache.block_tables(request.request_id) if self.kv_cache.grouped else (),
            sample=sample,
            sampling=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids if sample else (),
            generator=request.generator,
            banned_token_ids=banned,
            state_slot=self.kv_cache.state_slot(request.request_id),
            draft_token_ids=drafts,
            restore_state_from=self.kv_cache.take_restore(request.request_id),
            state_checkpoints=self.kv_cache.plan_checkpoints(request, start, end),
            next_token_id=None if sample or end == request.num_tokens else request.token_ids[end],
            prompt_logprob_targets=request.prompt_logprob_targets(start, end),
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
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        request.grammar = None  # frees the matcher
        request.grammar_future = None
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timings.finished = self.clock()
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

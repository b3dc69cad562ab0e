"""The engine's per-request state: the one object the scheduler, the KV cache manager and the
engine loop share (as nano-vllm's ``Sequence``)."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tokenline.engine.messages import EngineRequest, FinishReason, RequestTimings, TokenLogprobs

if TYPE_CHECKING:
    import torch

    from tokenline.structured_output.grammar import CompiledGrammar, GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; recomputed when re-admitted
    FINISHED = "finished"


class Request:
    """Engine-side state of one sequence being generated."""

    def __init__(
        self,
        engine_request: EngineRequest,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        device: str | torch.device = "cpu",
    ) -> None:
        self.request_id = engine_request.request_id
        self.sampling = engine_request.sampling
        self.priority = engine_request.priority
        self.arrival_time = engine_request.arrival_time
        self.prompt_token_ids = list(engine_request.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # One list holds prompt then output tokens, so a chunk of any position is a slice of it.
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.kv_matched_tokens = 0  # hybrid models: the KV match before the cut to a state checkpoint
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.timings = RequestTimings(arrival=self.arrival_time)
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        self.cache_salt = engine_request.cache_salt  # salts the first block's hash (block_pool.salt_root)
        self.generator: torch.Generator | None = None
        if self.sampling.seed is not None:
            # Imported here: the scheduler and KV books run without torch in a simulated engine.
            import torch

            # Each seeded request owns its RNG so its tokens do not depend on the rest of the batch.
            self.generator = torch.Generator(device=device).manual_seed(self.sampling.seed)
        self.num_outputs_sent = 0  # output tokens already reported to the frontend
        # Structured output: the compilation under way (the request waits until it is done), then
        # the request's own matcher, advanced on every accepted token.
        self.grammar_future: Future[CompiledGrammar] | None = None
        self.grammar_submitted: float = 0.0  # when it was submitted (the engine's clock)
        self.grammar: GrammarState | None = None
        # Prompt logprobs: the scores of prompt tokens 1, 2, ... as the chunks compute them, until
        # they go out with the request's first output.
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs_sent = False

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs that are not all computed yet."""
        return (
            self.sampling.prompt_logprobs is not None
            and not self.prompt_logprobs_sent
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def prompt_logprob_targets(self, start: int, end: int) -> list[int]:
        """The prompt tokens that positions ``start ..`` of a chunk ``start .. end`` score: each
        position's logits score the token after it, so the prompt's last position scores none."""
        if not self.scores_prompt:
            return []
        return self.token_ids[start + 1 : min(end + 1, self.num_prompt_tokens)]

    def add_prompt_logprobs(self, start: int, scores: list[TokenLogprobs]) -> None:
        """The scores of the tokens after positions ``start ..``; those already held (a chunk
        recomputed after a preemption) are skipped."""
        held = len(self.prompt_logprobs)
        if start <= held:
            self.prompt_logprobs.extend(scores[held - start :])

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """Once, when complete: one entry per prompt token, None for the first (nothing precedes it)."""
        if self.sampling.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        if len(self.prompt_logprobs) < self.num_prompt_tokens - 1:
            return None  # aborted before its prompt was computed
        self.prompt_logprobs_sent = True
        entries, self.prompt_logprobs = self.prompt_logprobs, []
        return [None, *entries]

    @property
    def waiting_for_grammar(self) -> bool:
        return self.grammar_future is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

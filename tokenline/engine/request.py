"""The engine's per-request state: the one object the scheduler, the KV cache manager and the
engine loop share (as nano-vllm's ``Sequence``)."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tokenline.engine.messages import EngineRequest, FinishReason, RequestTimings

if TYPE_CHECKING:
    import torch

    from tokenline.model.grammar import CompiledGrammar, GrammarState


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

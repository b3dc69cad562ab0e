"""The request records that cross the frontend/engine boundary, and the engine's per-request state.

``EngineRequest`` goes in, ``EngineOutput`` comes out; ``Request`` is the one state object the
scheduler, the KV cache manager and the engine share (as nano-vllm's ``Sequence``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenline.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; recomputed when re-admitted
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or (frontend) a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client went away, timeout, explicit cancel
    ERROR = "error"


@dataclass
class EngineRequest:
    """What the frontend hands the engine: token ids only, never text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # resolved with the model's generation-config defaults
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first; ties go to the earlier arrival


@dataclass
class RequestTimings:
    """Monotonic timestamps of one request's life inside the engine (seconds)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class TokenLogprobs:
    """Log-probability of a generated token and, when asked, the top alternatives at that step."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class EngineOutput:
    """What one engine step tells the frontend about one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.timings = RequestTimings(arrival=self.arrival_time)
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        self.generator: torch.Generator | None = None
        if self.sampling.seed is not None:
            # Each seeded request owns its RNG so its tokens do not depend on the rest of the batch.
            self.generator = torch.Generator(device=device).manual_seed(self.sampling.seed)
        self.num_outputs_sent = 0  # output tokens already reported to the frontend

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

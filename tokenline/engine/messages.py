"""Records that cross the frontend/engine boundary (and the process boundary): no torch here.

``EngineRequest`` goes in, ``EngineOutput`` comes out; the engine process sends its ``EngineStats``
beside them. Everything is a plain dataclass so it pickles cheaply between processes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenline.model.batch import TokenLogprobs  # defined beside the runner that produces it
from tokenline.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenline.engine.kv_events import KVCacheEvent


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
    client_request_id: str | None = None  # the caller's X-Request-Id: joins engine logs to the edge's
    session_id: str | None = None  # the caller's session key (OpenAI's ``user``): session affinity in a fleet
    # Folded into the hash of the prompt's first KV block (block_pool.salt_root): prompts with
    # different salts never share cached blocks. The API process sets it from the tenant and the
    # caller's ``cache_salt`` (gateway/cache_scope.py); None: the prefix cache is shared.
    cache_salt: str | None = None
    tenant: str | None = None  # the caller's tenant: per-tenant engine caches (compiled grammars)


@dataclass
class RequestTimings:
    """Monotonic timestamps of one request's life inside the engine (seconds; CLOCK_MONOTONIC is
    shared by all processes of a machine, so they compare with the API process's clock)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_steps: int = 0  # engine steps that computed some of its tokens
    num_shared_steps: int = 0  # of those, steps whose batch also held other requests


@dataclass
class EngineOutput:
    """What one engine step tells the frontend about one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # With the request's first output, when it asked for prompt logprobs: one entry per prompt
    # token (logprob, rank, top k), None for the first token, which nothing precedes.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """A snapshot of the engine's load, sent with every step's outputs."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    spec_decode_num_drafts: int = 0  # speculative steps (a request verifying drafts)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Hybrid models: the KV match before the cut to a state checkpoint (prefix_cache_hits counts
    # what was reused), and the checkpoint pool: slots, slots used, saves, admissions restored.
    prefix_cache_kv_matched: int = 0
    num_state_checkpoints: int = 0
    num_state_checkpoints_used: int = 0
    state_checkpoints_saved: int = 0
    state_checkpoint_hits: int = 0
    # Structured output: grammars compiled (and the seconds they took), and requests whose
    # grammar was already compiled or compiling (a cache hit).
    grammar_compile_count: int = 0
    grammar_compile_seconds_sum: float = 0.0
    grammar_cache_hits: int = 0
    # The compiled-grammar cache: its estimated bytes, its grammars (compiling ones included), and
    # grammars evicted to keep it within --grammar-cache-bytes.
    grammar_cache_bytes: int = 0
    grammar_cache_entries: int = 0
    grammar_cache_evictions: int = 0


@dataclass
class StepRecord:
    """What one engine step did, for live pages, logs and a simulator's step-time model.

    Times come from the engine's clock (monotonic seconds, or simulated time). A *decode* token is
    a sequence's newest output token (with any drafts verified beside it); every other computed
    token — prompt chunks, and recomputation after a preemption — counts as *prefill*. Loads
    (running, waiting, blocks, slots) are taken after the step.
    """

    step: int  # index of this step in the engine's life, from 0
    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int  # sequences in the batch
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks: int
    num_state_slots_used: int = 0  # hybrid models: recurrent-state slots held
    num_state_slots: int = 0
    num_preemptions: int = 0  # requests preempted while forming this step's batch
    num_draft_tokens: int = 0  # of the decode tokens, speculative drafts being verified
    num_context_tokens: int = 0  # per sequence, every position its new tokens attend to (the KV read)
    # Prefill chunks' query-key pairs: each new token times the positions it attends to. A chunk's
    # attention grows with its tokens times its context, which the KV read above counts once.
    num_prefill_attention_pairs: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


# --- messages between the API process and the engine process --------------------------------


@dataclass
class AddRequest:
    request: EngineRequest


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class ResetPrefixCache:
    """Drop every cached prefix (benchmarks, tests, a model swap); the engine reports
    ``AllBlocksCleared``."""


@dataclass
class EngineReady:
    """Sent once the model is loaded and the KV cache allocated."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    dtype: str


@dataclass
class EngineFailed:
    """The engine could not start, or crashed; in-flight requests end with a server error."""

    error: str


@dataclass
class RequestFailed:
    """The engine refused one request (it can never fit); ``param`` names the culprit."""

    request_id: str
    param: str
    message: str


@dataclass
class StepOutputs:
    outputs: list[EngineOutput]
    stats: EngineStats
    # What happened since the previous StepOutputs, in order: normally one step's record and KV
    # events (a reset between steps adds its AllBlocksCleared). Events only when the engine records
    # them (EngineConfig.enable_kv_cache_events or kv_events_endpoint).
    kv_events: list[KVCacheEvent] = field(default_factory=list)
    step_records: list[StepRecord] = field(default_factory=list)

"""Per-request sampling parameters: the contract between the API, the engine and the sampler.

Fields left as ``None`` mean "not set by the caller"; :meth:`SamplingParams.with_defaults` fills them
from the model's generation config, the way vLLM applies ``generation_config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

# Values used when neither the request nor the model's generation config sets a field.
_FALLBACKS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# generation_config.json keys that map onto our fields.
GENERATION_CONFIG_KEYS = tuple(_FALLBACKS)

MAX_LOGPROBS = 20  # the OpenAI API's limit on top_logprobs
GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily (see SamplingParams.greedy)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``param`` names it for the API's error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of ``json`` (a
    JSON schema, as a dict or JSON text), ``json_object`` (any JSON object), ``regex``, ``choice``
    (one of these strings) or ``grammar`` (Lark, llguidance's dialect, with ``%json{...}`` inline
    schemas) is set. ``start_after_token_id``: the constraint applies only once this token id has
    been generated (e.g. a reasoning model's ``</think>``); None applies it from the first token.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    start_after_token_id: int | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar"
                + (f"; got {', '.join(kinds)}" if kinds else ""),
            )
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise SamplingParamsError("structured_outputs.choice", "choice must be a list of strings")
            if not self.choice:
                raise SamplingParamsError("structured_outputs.choice", "choice must not be empty")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise SamplingParamsError("structured_outputs.json", "json must be a JSON schema (an object or JSON text)")
        if self.start_after_token_id is not None and self.start_after_token_id < 0:
            raise SamplingParamsError("structured_outputs", "start_after_token_id must be a token id (>= 0)")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def key(self) -> str:
        """Canonical JSON text of the constraint (not of ``start_after_token_id``, which does not
        change the grammar): equal constraints give equal keys, so compiled grammars are cached by it."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass  # invalid JSON text: its own key; validation reports it
        return json.dumps([self.kind, value], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float | None = None  # 0 means greedy
    top_p: float | None = None  # 1.0 disables
    top_k: int | None = None  # 0 or -1 disables
    min_p: float | None = None  # 0.0 disables
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # 1.0 disables
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length; 0: the prompt only (to score it)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # applied by the frontend, never the engine
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    prompt_logprobs: int | None = None  # each prompt token's logprob (and rank), plus the top k there
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise SamplingParamsError(name, f"{name} must be a finite number, got {value}")
        if self.n < 1:
            raise SamplingParamsError("n", f"n must be at least 1, got {self.n}")
        if self.temperature is not None and self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.max_tokens is not None and self.max_tokens < 0:
            raise SamplingParamsError("max_tokens", f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SamplingParamsError(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be a StructuredOutputs")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if int(token_id) < 0:
                    raise SamplingParamsError("logit_bias", f"logit_bias has a negative token id {token_id}")
                if not -100.0 <= bias <= 100.0:
                    raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")

    def with_defaults(self, generation_config: dict[str, Any] | None = None) -> SamplingParams:
        """Fill unset fields from the model's generation config, then from neutral fallbacks."""
        generation_config = generation_config or {}
        updates: dict[str, Any] = {}
        for key, fallback in _FALLBACKS.items():
            if getattr(self, key) is None:
                value = generation_config.get(key)
                updates[key] = fallback if value is None else value
        # A generation config that disables sampling means greedy unless the caller asked otherwise.
        if self.temperature is None and generation_config.get("do_sample") is False:
            updates["temperature"] = 0.0
        return dataclasses.replace(self, **updates) if updates else self

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of the ``n`` sequences of a request: each is generated on
        its own (n=1), and a seeded request gives each sequence its own seed so the samples differ."""
        seed = self.seed
        if seed is not None:
            # Stay inside torch's seed range [-2**63, 2**64 - 1] whatever the caller's seed.
            seed = (seed + index) % (1 << 64)
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_TEMPERATURE are greedy: dividing by them would only overflow."""
        return self.temperature is not None and self.temperature < GREEDY_TEMPERATURE

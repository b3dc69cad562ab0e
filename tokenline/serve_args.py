"""vLLM's ``serve`` flags on ``tokenline serve``: one table saying what each one does here.

A command line copied from ``vllm serve`` should start. Each flag in ``VLLM_FLAGS`` is either wired
to the tokenline setting of the same meaning, accepted with no effect here (named in one start-up
warning, never silently), or refused for a value tokenline cannot honour (one line, exit status 2).
Flags tokenline already had under vLLM's names (``--max-model-len``, ``--tool-call-parser``, ...)
live with the other serve and engine flags in ``cli.py``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, json_object_flag
from tokenline.store.model_store import DEFAULT_MODEL_NAME

WIRED, NO_EFFECT, LIMITED = "wired", "no effect", "limited"


class ServeArgsError(ValueError):
    """A flag value tokenline cannot honour; the message is the whole explanation (one line)."""


def _none(value: Any) -> str | None:
    return None


def _single(what: str) -> Callable[[Any], str | None]:
    def refuse(value: Any) -> str | None:
        return None if value in (None, 1) else f"tokenline runs {what}; only 1 is supported, got {value}"
    return refuse


def _positive(flag: str) -> Callable[[Any], str | None]:
    def refuse(value: Any) -> str | None:
        return None if value is None or value >= 1 else f"must be at least 1, got {value}"
    return refuse


def _refuse_quantization(value: Any) -> str | None:
    if value is None or value in QUANTIZATIONS:
        return None
    return (f"quantization {value!r} is not supported: tokenline quantizes weights only to ggml's blocks "
            f"({', '.join(QUANTIZATIONS)})")


def _refuse_kv_cache_dtype(value: Any) -> str | None:
    if value is None or value in KV_CACHE_DTYPES:
        return None
    return f"kv cache dtype {value!r} is not supported: choose {' or '.join(KV_CACHE_DTYPES)}"


def _refuse_max_logprobs(value: Any) -> str | None:
    if value is None or value <= 20:
        return None
    return f"at most 20 logprobs per token are returned (the OpenAI API's limit); got {value}"


# vLLM's --speculative-config methods tokenline runs, as its own --speculative values.
SPECULATIVE_METHODS = {"ngram": "ngram", "suffix": "suffix", "mtp": "mtp", "qwen3_next_mtp": "mtp",
                       "qwen3_5_mtp": "mtp"}
SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor",
                    "suffix_decoding_min_token_prob"}


def speculative_config_fields(text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON (``{"method": "mtp", "num_speculative_tokens": 2}``) as
    EngineConfig fields; ServeArgsError for a method or key tokenline does not run."""
    raw = json_object_flag("--speculative-config", text, SPECULATIVE_KEYS, ServeArgsError,
                           "; tokenline has no separate draft models")
    method = raw.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ServeArgsError(f"--speculative-config: method {method!r} is not supported; "
                             f"one of {sorted(SPECULATIVE_METHODS)}")
    fields = {"speculative": SPECULATIVE_METHODS[method]}
    fields.update({key: raw[key] for key in SPECULATIVE_KEYS - {"method"} if key in raw})
    return fields


def speculative_config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields a given ``--speculative-config`` sets (none when it is not given)."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return {}
    if getattr(args, "speculative", None) is not None:
        raise ServeArgsError("give --speculative or --speculative-config, not both")
    return speculative_config_fields(text)


def _refuse_speculative_config(value: Any) -> str | None:
    if value is None:
        return None
    try:
        speculative_config_fields(value)
    except ServeArgsError as exc:
        return str(exc).removeprefix("--speculative-config: ")
    return None


def _refuse_executor(value: Any) -> str | None:
    if value in (None, "mp", "uni"):
        return None
    return f"executor backend {value!r} is not supported: tokenline runs one engine process"


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # the long flag first, then vLLM's short forms
    status: str  # WIRED, NO_EFFECT (accepted, changes nothing here) or LIMITED (some values refused)
    does: str  # what tokenline does with it: help text, start-up warning and the README table
    options: dict[str, Any] = field(default_factory=dict)  # argparse options
    refuse: Callable[[Any], str | None] = _none  # why a value cannot be honoured, or None
    # The given value changes nothing here (default: any value of a NO_EFFECT flag that was given).
    idle: Callable[[Any], bool] | None = None

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.names[0].lstrip("-").replace("-", "_")

    def has_no_effect(self, value: Any) -> bool:
        if value is None:
            return False  # not given
        if self.idle is not None:
            return self.idle(value)
        return self.status == NO_EFFECT and value is not False  # a switch left off was not given


# Flags tokenline did not already have. Defaults are None (False for switches) so "given" is visible.
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--model",), WIRED, "the model directory or .gguf file, as the positional argument",
             {"dest": "model_option", "metavar": "MODEL"}),
    VllmFlag(("--enable-auto-tool-choice",), WIRED,
             "needs --tool-call-parser, as in vLLM (which already lets the model choose tools here)",
             {"action": "store_true"}),
    VllmFlag(("--chat-template",), WIRED, "a Jinja file, or an inline template, replacing the model's"),
    VllmFlag(("--generation-config",), WIRED,
             "sampling defaults: auto = the model's generation_config.json, vllm = none, or a folder with one",
             {"default": "auto"}),
    VllmFlag(("--seed",), WIRED, "seeds the sampling of requests that bring no seed", {"type": int}),
    VllmFlag(("--tokenizer",), WIRED, "a directory whose tokenizer replaces the model's"),
    VllmFlag(("--disable-log-requests",), WIRED, "no log line per finished request", {"action": "store_true"}),
    VllmFlag(("--disable-uvicorn-access-log",), WIRED, "no access log line per HTTP request",
             {"action": "store_true"}),
    VllmFlag(("--uvicorn-log-level",), WIRED, "uvicorn's log level",
             {"default": "info", "choices": ["critical", "error", "warning", "info", "debug", "trace"]}),
    VllmFlag(("--enable-chunked-prefill",), LIMITED,
             "prefill is always chunked (within --max-num-batched-tokens); turning it off has no effect",
             {"action": argparse.BooleanOptionalAction, "default": None}, idle=lambda v: v is False),
    VllmFlag(("--tensor-parallel-size", "-tp"), LIMITED, "one engine on one device: 1 changes nothing, more is refused",
             {"type": int}, refuse=_single("one engine on one device"), idle=lambda v: v == 1),
    VllmFlag(("--pipeline-parallel-size", "-pp"), LIMITED,
             "one engine on one device: 1 changes nothing, more is refused", {"type": int},
             refuse=_single("one engine on one device"), idle=lambda v: v == 1),
    VllmFlag(("--data-parallel-size", "-dp"), WIRED,
             "N engine processes behind this API process, --routing-policy choosing one per request",
             {"type": int, "default": 1}, refuse=_positive("--data-parallel-size")),
    VllmFlag(("--distributed-executor-backend",), LIMITED,
             "one engine process: mp / uni change nothing, ray is refused",
             {"choices": ["mp", "uni", "ray", "external_launcher"]}, refuse=_refuse_executor, idle=lambda v: True),
    VllmFlag(("--quantization", "-q"), LIMITED,
             "q4_1 or q8_0: weight-only quantization in ggml's blocks (the head Q8_0), read in place by our "
             "kernels; a GGUF's own Q4_1 blocks for the default model; other methods refused",
             refuse=_refuse_quantization, idle=lambda v: False),
    VllmFlag(("--kv-cache-dtype",), LIMITED,
             "auto (the KV cache in --dtype) or bfloat16 (half a float32 model's KV: rounded on write, widened "
             "on read); fp8 formats refused",
             refuse=_refuse_kv_cache_dtype, idle=lambda v: False),
    VllmFlag(("--max-logprobs",), LIMITED, "top logprobs are capped at 20 (OpenAI's limit): a lower cap is not enforced, a higher one refused",
             {"type": int},
             refuse=_refuse_max_logprobs, idle=lambda v: v < 20),
    VllmFlag(("--speculative-config",), LIMITED,
             "JSON: method ngram, suffix or mtp (qwen3_next_mtp, qwen3_5_mtp alike), num_speculative_tokens, "
             "prompt_lookup_max/min, suffix_decoding_max_tree_depth/max_spec_factor/min_token_prob, as "
             "--speculative and its flags; draft-model methods are refused",
             refuse=_refuse_speculative_config, idle=lambda v: False),
    VllmFlag(("--gpu-memory-utilization",), NO_EFFECT, "the KV cache gets --kv-cache-memory GiB instead",
             {"type": float}),
    VllmFlag(("--swap-space",), NO_EFFECT, "a preempted request is recomputed, never swapped", {"type": float}),
    VllmFlag(("--cpu-offload-gb",), NO_EFFECT, "weights already live in CPU memory", {"type": float}),
    VllmFlag(("--enforce-eager",), NO_EFFECT, "there are no CUDA graphs to turn off", {"action": "store_true"}),
    VllmFlag(("--trust-remote-code",), NO_EFFECT, "no model code is ever downloaded or run",
             {"action": "store_true"}),
    VllmFlag(("--download-dir",), NO_EFFECT, "nothing is downloaded; see `tokenline import`"),
    VllmFlag(("--disable-log-stats",), NO_EFFECT, "there is no periodic stats log (see /metrics)",
             {"action": "store_true"}),
)


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """Add ``VLLM_FLAGS`` to the ``serve`` parser."""
    group = parser.add_argument_group("vLLM compatibility", "vLLM's serve flags; see README 'Coming from vLLM'")
    for flag in VLLM_FLAGS:
        options = {"default": None, **flag.options, "help": flag.does}
        group.add_argument(*flag.names, **options)


def check_vllm_args(args: argparse.Namespace) -> list[str]:
    """Refuse values tokenline cannot honour (``ServeArgsError``); return the given flags that have
    no effect here, each as ``--flag value (why)`` for the start-up warning."""
    if getattr(args, "model_option", None) is not None:
        if args.model is not None and args.model != args.model_option:
            raise ServeArgsError(f"two models given: {args.model!r} and --model {args.model_option!r}")
        args.model = args.model_option
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ServeArgsError("--enable-auto-tool-choice needs --tool-call-parser (see its choices), as in vLLM")
    idle = []
    for flag in VLLM_FLAGS:
        value = getattr(args, flag.dest)
        reason = flag.refuse(value)
        if reason is not None:
            raise ServeArgsError(f"{flag.names[0]}: {reason}")
        if flag.has_no_effect(value):
            shown = flag.names[0] if isinstance(value, bool) else f"{flag.names[0]} {value}"
            idle.append(f"{shown} ({flag.does})")
    return idle


def check_model_argument(model: str | None) -> None:
    """A model argument must be a local directory or file: nothing is ever downloaded, so a Hugging
    Face repo id gets one line saying how to bring the model in."""
    if model is None or model == DEFAULT_MODEL_NAME or Path(model).expanduser().exists():
        return
    raise ServeArgsError(
        f"model {model!r} is neither a directory nor a file, and tokenline downloads nothing. Pass an "
        "HF-format model directory (config.json, safetensors, tokenizer.json) or a .gguf file (imported once; "
        f"`tokenline import FILE.gguf` does it ahead of time), or no model for the default {DEFAULT_MODEL_NAME}."
    )


def check_tokenizer_argument(tokenizer: str | None) -> None:
    if tokenizer is not None and not (Path(tokenizer).expanduser() / "tokenizer.json").is_file():
        raise ServeArgsError(f"--tokenizer {tokenizer!r} is not a directory with a tokenizer.json "
                             "(tokenline downloads nothing)")


def quiet_request_logs(args: argparse.Namespace) -> None:
    """--disable-log-requests / --disable-uvicorn-access-log: keep warnings, drop the per-request lines."""
    if args.disable_log_requests:
        logging.getLogger("tokenline.gateway").setLevel(logging.WARNING)
    if args.disable_uvicorn_access_log:
        logging.getLogger("tokenline.access").setLevel(logging.WARNING)


def no_effect_warning(idle: list[str]) -> str | None:
    """The one start-up line naming every accepted flag that changes nothing here."""
    if not idle:
        return None
    return "vLLM flags accepted with no effect in tokenline: " + "; ".join(idle)

"""vLLM's ``serve`` flags on ``tokenline serve`` and ``router``: what each one does here, read from
the declarations (``vllm=`` on a setting).

A command line copied from ``vllm serve`` should start. Each such flag is either wired to the
tokenline setting of the same meaning, accepted with no effect here (named in one start-up warning,
never silently), or refused for a value tokenline cannot honour (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.store.model_store import DEFAULT_MODEL_NAME, PACKAGED_MODELS
from tokenline.setting_field import Declared
from tokenline.settings.catalog import all_declared
from tokenline.settings.speculative_config import ServeArgsError, speculative_config_fields


@dataclass(frozen=True)
class VllmFlag:
    """A declared setting seen as a vLLM flag."""

    declared: Declared

    @property
    def names(self) -> tuple[str, ...]:
        return self.declared.setting.flags

    @property
    def status(self) -> str:
        return str(self.declared.setting.vllm)

    @property
    def does(self) -> str:
        return self.declared.setting.help

    @property
    def dest(self) -> str:
        return self.declared.dest


VLLM_FLAGS: tuple[VllmFlag, ...] = tuple(VllmFlag(d) for d in all_declared() if d.setting.vllm)

def speculative_config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields a given ``--speculative-config`` sets (none when it is not given)."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return {}
    if getattr(args, "speculative", None) is not None:
        raise ServeArgsError("give --speculative or --speculative-config, not both")
    return speculative_config_fields(text)


def check_vllm_args(args: argparse.Namespace) -> list[str]:
    """Refuse values tokenline cannot honour (``ServeArgsError``); return the given flags that have
    no effect here, each as ``--flag value (why)`` for the start-up warning."""
    model = getattr(args, "model", None)  # serve's positional (router has none)
    if getattr(args, "model_option", None) is not None:
        if model is not None and model != args.model_option:
            raise ServeArgsError(f"two models given: {model!r} and --model {args.model_option!r}")
        model = args.model_option
    args.model = model
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ServeArgsError("--enable-auto-tool-choice needs --tool-call-parser (see its choices), as in vLLM")
    idle = []
    for flag in VLLM_FLAGS:
        value = getattr(args, flag.dest)
        reason = flag.declared.setting.refuse(value)
        if reason is not None:
            raise ServeArgsError(f"{flag.names[0]}: {reason}")
        if flag.declared.setting.has_no_effect(value):
            shown = flag.names[0] if isinstance(value, bool) else f"{flag.names[0]} {value}"
            idle.append(f"{shown} ({flag.does})")
    return idle


def check_model_argument(model: str | None) -> None:
    """A model argument must be a local directory or file, or a packaged model's name (gemma3-270m):
    nothing is ever downloaded, so a Hugging Face repo id gets one line saying how to bring the model in."""
    if model is None or model in (DEFAULT_MODEL_NAME, *PACKAGED_MODELS) or Path(model).expanduser().exists():
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

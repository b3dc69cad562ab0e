"""vLLM's ``--speculative-config`` JSON read as tokenline's speculative settings."""

from __future__ import annotations

from typing import Any

from tokenline.engine.config import json_object_flag


class ServeArgsError(ValueError):
    """A flag value tokenline cannot honour; the message is the whole explanation (one line)."""


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

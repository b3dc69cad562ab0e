"""Engine settings (named like vLLM's flags) and the one place that assembles an engine from them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from collections.abc import Callable, Collection
from typing import Any

from tokenline.spec_decode.ngram_proposer import check_ngram_settings
from tokenline.spec_decode.suffix_proposer import check_suffix_settings
from tokenline.setting_field import (
    API_COMMANDS, ENGINE, ENGINE_COMMANDS, KV_CACHE, LIMITED, MODEL, SERVE, SIMULATE, SPECULATIVE, STRUCTURED, WIRED,
    setting,
)


GIB = 1 << 30
# --quantization's values: the formats of tokenline.model.quantization (kept torch-free here for the
# API process's flag checks; a test holds the two equal).
QUANTIZATIONS = ("q4_1", "q8_0")
# --kv-cache-dtype's values, vLLM's spelling: auto keeps the KV in --dtype; bfloat16 halves a
# float32 model's KV (rounded on write, widened on read; activations stay float32).
KV_CACHE_DTYPES = ("auto", "bfloat16")


# A step's default token budget (--max-num-batched-tokens). 1024 rather than vLLM's CPU default of
# 2048: a wave of prompts is then prefilled a few at a time, so the first of them start decoding
# sooner; on the 2-core AVX-512 box, c=8 / c=32 TTFT p50 0.70-0.76x / 0.53-0.66x what 2048 gave,
# output tok/s within the runs' spread (README, "The step budget").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


def refuse_quantization(value: Any) -> str | None:
    """Why serve cannot honour vLLM's ``--quantization VALUE`` (None: it can)."""
    if value is None or value in QUANTIZATIONS:
        return None
    return (f"quantization {value!r} is not supported: tokenline quantizes weights only to ggml's blocks "
            f"({', '.join(QUANTIZATIONS)})")


def refuse_kv_cache_dtype(value: Any) -> str | None:
    if value is None or value in KV_CACHE_DTYPES:
        return None
    return f"kv cache dtype {value!r} is not supported: choose {' or '.join(KV_CACHE_DTYPES)}"


_ALL = ENGINE_COMMANDS | API_COMMANDS


@dataclass
class EngineConfig:
    dtype: str = setting("auto", "--dtype", group=MODEL, choices=["auto", "float32", "bfloat16", "float16"],
                         help="weights and activations dtype (auto = bfloat16)")
    device: str = setting("cpu", "--device", group=ENGINE, help="the torch device the engine runs on")
    # Weight-only quantization of the linear layers to ggml's blocks: "q4_1" or "q8_0" (None: --dtype).
    quantization: str | None = setting(
        None, "--quantization", "-q", group=MODEL, commands=_ALL, choices=QUANTIZATIONS, vllm=LIMITED,
        refuse=refuse_quantization, idle=lambda v: False,
        help="q4_1 or q8_0: weight-only quantization in ggml's blocks (the head Q8_0), read in place by our "
             "kernels; a GGUF's own Q4_1 blocks for the default model; other methods refused")
    kv_cache_dtype: str = setting(
        "auto", "--kv-cache-dtype", group=KV_CACHE, commands=_ALL, choices=KV_CACHE_DTYPES, vllm=LIMITED,
        refuse=refuse_kv_cache_dtype, idle=lambda v: False,
        help="auto (the KV cache in --dtype) or bfloat16 (half a float32 model's KV: rounded on write, widened "
             "on read); fp8 formats refused")
    block_size: int = setting(16, "--block-size", group=KV_CACHE, type=int, help="tokens per KV cache block")
    kv_cache_memory_gib: float = setting(2.0, "--kv-cache-memory", group=KV_CACHE, type=float, metavar="GIB",
                                         help="GiB of memory for the KV cache (like VLLM_CPU_KVCACHE_SPACE)")
    # Tests use tiny pools.
    num_kv_blocks: int | None = setting(None, "--num-kv-blocks", group=KV_CACHE, commands={SERVE}, type=int,
                                        help="KV cache blocks (overrides --kv-cache-memory)")
    max_model_len: int | None = setting(None, "--max-model-len", group=MODEL, type=int,
                                        help="context length (default: the model's)")
    max_num_seqs: int = setting(128, "--max-num-seqs", group=ENGINE, commands=ENGINE_COMMANDS | {SIMULATE},
                                type=int, help="most sequences in one step")
    max_num_batched_tokens: int = setting(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, "--max-num-batched-tokens", group=ENGINE,
        commands=ENGINE_COMMANDS | {SIMULATE}, type=int, help="token budget of one step (prefill chunks + decodes)")
    enable_prefix_caching: bool = setting(True, "--enable-prefix-caching", group=KV_CACHE,
                                          action=argparse.BooleanOptionalAction,
                                          help="reuse cached prompt prefixes (on by default)")
    # Free cached prefixes keep their blocks while less than this much of the KV pool was ever
    # touched; past it they are evicted before never-touched blocks, so resident KV is at most this
    # or the peak in use at once (block_pool.py). prefix_cache_fills_pool overrides it: True lets
    # the prefix cache fill the whole pool (all of kv_cache_memory_gib resident in the end), False
    # keeps resident KV at the peak in use.
    prefix_cache_resident_memory_gib: float = setting(
        0.5, "--prefix-cache-resident-memory", group=KV_CACHE, type=float, metavar="GIB",
        help="freed prefixes stay cached in fresh KV memory until this many GiB of the pool were touched; past "
             "it they are evicted before touching more, so resident KV is at most this or the peak in use")
    prefix_cache_fills_pool: bool | None = setting(
        None, "--prefix-cache-fills-pool", group=KV_CACHE, action=argparse.BooleanOptionalAction,
        help="overrides --prefix-cache-resident-memory: keep freed prefixes cached until the whole KV pool is in "
             "use (more prefix hits, all of --kv-cache-memory resident in the end); --no-... evicts them before "
             "touching new memory, so resident KV is the peak in use")
    # Hybrid models: prefix caching through recurrent-state checkpoints, one kept every this many
    # tokens (a multiple of block_size; None: 4 blocks) besides each prompt's end and each
    # sequence's deepest block; the pool holds this many (None: 2 x max_num_seqs, at most half of
    # the cache memory). 0 turns prefix caching off for hybrid models.
    hybrid_state_checkpoint_interval: int | None = setting(
        None, "--hybrid-state-checkpoint-interval", group=KV_CACHE, type=int, metavar="TOKENS",
        help="hybrid models: keep a recurrent-state checkpoint every TOKENS tokens, a multiple of --block-size "
             "(default: 4 blocks), besides each prompt's end")
    hybrid_state_checkpoints: int | None = setting(
        None, "--hybrid-state-checkpoints", group=KV_CACHE, type=int, metavar="N",
        help="hybrid models: state checkpoint slots (default: 2 x --max-num-seqs, at most half of "
             "--kv-cache-memory); 0 turns prefix caching off for them")
    check_integrity_every_step: bool = False
    # Speculative decoding (greedy requests): "ngram" drafts by prompt lookup, "suffix" from a
    # suffix tree of the request's tokens (adaptive length), "mtp" with the checkpoint's own
    # multi-token-prediction head (hybrid Qwen3.5-class models).
    speculative: str | None = setting(
        None, "--speculative", group=SPECULATIVE, choices=["ngram", "suffix", "mtp"],
        help="speculative decoding for greedy requests; ngram: drafts looked up in the context; suffix: drafts "
             "from a suffix tree of the request's tokens, adaptive length; mtp: drafts from the checkpoint's own "
             "multi-token-prediction head (hybrid Qwen3.5)")
    num_speculative_tokens: int = setting(4, "--num-speculative-tokens", group=SPECULATIVE, type=int,
                                          help="most draft tokens per request and step")
    prompt_lookup_max: int = setting(4, "--prompt-lookup-max", group=SPECULATIVE, type=int,
                                     help="longest n-gram the ngram proposer matches")
    prompt_lookup_min: int = setting(2, "--prompt-lookup-min", group=SPECULATIVE, type=int,
                                     help="shortest n-gram the ngram proposer matches")
    # Suffix decoding, named as vLLM's: the tree's depth (match + draft), drafts at most this factor
    # x the match length, and the least estimated probability a drafted run may have.
    suffix_decoding_max_tree_depth: int = setting(
        24, "--suffix-decoding-max-tree-depth", group=SPECULATIVE, type=int,
        help="suffix proposer: deepest substring the tree holds (match + draft)")
    suffix_decoding_max_spec_factor: float = setting(
        1.0, "--suffix-decoding-max-spec-factor", group=SPECULATIVE, type=float,
        help="suffix proposer: drafts at most this factor x the match length")
    suffix_decoding_min_token_prob: float = setting(
        0.1, "--suffix-decoding-min-token-prob", group=SPECULATIVE, type=float,
        help="suffix proposer: stop drafting where the estimated probability falls below this")
    # KV cache events (vLLM's --kv-events-config): recorded by the block pool and sent with every
    # StepOutputs; with an endpoint also published on a ZMQ PUB socket the engine binds, e.g.
    # "tcp://127.0.0.1:5557", with an optional ROUTER socket that replays missed batches.
    enable_kv_cache_events: bool = False
    kv_events_endpoint: str | None = None  # implies enable_kv_cache_events
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # Structured output: a grammar that has not compiled after this long fails its request.
    grammar_compile_timeout_s: float = 10.0
    # Memory the compiled grammars may hold (structured_output/grammar.py's estimate), least recently used
    # evicted first; 0: none is kept after its requests.
    grammar_cache_bytes: int = setting(
        256 << 20, "--grammar-cache-bytes", group=STRUCTURED, type=int, metavar="BYTES",
        help="memory the compiled structured-output grammars may hold, least recently used evicted first "
             "(0 keeps none)")
    # Threads for the engine's torch ops and kernels (None: torch's default, all cores); with
    # --data-parallel-size the cores are split between the engines.
    num_threads: int | None = None
    data_parallel_rank: int = 0  # which engine of a data-parallel server (KV events carry it)
    # vLLM's --seed: seeds the RNG of requests that bring no seed of their own.
    seed: int | None = setting(None, "--seed", group=ENGINE, commands=API_COMMANDS, type=int, vllm=WIRED,
                               help="seeds the sampling of requests that bring no seed")
    # vLLM's --tokenizer: a directory whose tokenizer.json replaces the model's.
    tokenizer: str | None = setting(None, "--tokenizer", group=MODEL, commands=API_COMMANDS, vllm=WIRED,
                                    help="a directory whose tokenizer replaces the model's")
    # Builds the engine core instead of loading the model: a picklable callable (it travels to the
    # spawned engine process) taking (config, model_dir, vocab_size), e.g. tokenline.sim's
    # simulated replica (serve --simulate). None: the model. It returns an EngineCore, not named
    # here: the engine core imports this module's defaults.
    core_factory: Callable[[EngineConfig, Path, int | None], Any] | None = None

    @property
    def kv_cache_events(self) -> bool:
        return self.enable_kv_cache_events or self.kv_events_endpoint is not None

    def cache_resident_blocks(self, num_blocks: int, block_bytes: int) -> int | None:
        """BlockPool's cache_resident_blocks for a pool of ``num_blocks`` of ``block_bytes`` each (None:
        the whole pool)."""
        if self.prefix_cache_fills_pool is not None:
            return None if self.prefix_cache_fills_pool else 0
        return min(num_blocks, int(self.prefix_cache_resident_memory_gib * GIB) // max(1, block_bytes))

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        interval = self.hybrid_state_checkpoint_interval
        if interval is not None and (interval < self.block_size or interval % self.block_size):
            raise ValueError(
                f"hybrid_state_checkpoint_interval must be a positive multiple of the block size "
                f"({self.block_size}), got {interval}"
            )
        if self.hybrid_state_checkpoints is not None and self.hybrid_state_checkpoints < 0:
            raise ValueError(f"hybrid_state_checkpoints must be >= 0, got {self.hybrid_state_checkpoints}")
        if self.num_kv_blocks is None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be positive")
        if self.prefix_cache_resident_memory_gib < 0:
            raise ValueError("prefix_cache_resident_memory_gib must be >= 0")
        if self.speculative not in (None, "ngram", "suffix", "mtp"):
            raise ValueError(f"speculative must be 'ngram', 'suffix', 'mtp' or unset, got {self.speculative!r}")
        check_ngram_settings(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)
        check_suffix_settings(self.num_speculative_tokens, self.suffix_decoding_max_tree_depth,
                              self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or unset, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype {self.kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be positive")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")


def json_object_flag(flag: str, text: str, known: Collection[str], error: type[ValueError] = ValueError,
                     hint: str = "") -> dict[str, Any]:
    """A flag whose value is a JSON object with keys among ``known`` (vLLM's --kv-events-config,
    --speculative-config), parsed; otherwise ``error`` says what is wrong, naming the flag, with
    ``hint`` after the unknown keys."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise error(f"{flag} must be a JSON object")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise error(f"{flag}: {unknown} not supported (known: {sorted(known)}){hint}")
    return raw


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """vLLM's ``--kv-events-config`` JSON (``{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": …, "topic": …}``) as EngineConfig fields."""
    known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic"}
    raw = json_object_flag("--kv-events-config", text, known)
    publisher = raw.get("publisher", "zmq")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {publisher!r}")
    enabled = bool(raw.get("enable_kv_cache_events", False))
    publish = enabled and publisher == "zmq"
    endpoint = raw.get("endpoint", "tcp://127.0.0.1:5557") if publish else None
    return {
        "enable_kv_cache_events": enabled,
        "kv_events_endpoint": endpoint,
        "kv_events_replay_endpoint": raw.get("replay_endpoint") if publish else None,
        "kv_events_topic": str(raw.get("topic", "")),
    }


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """``tcp://host:port`` moved ``offset`` ports up: each data-parallel engine publishes its KV
    events on the base port plus its rank, as vLLM does. Other transports get a ``-rank`` suffix."""
    if endpoint is None or offset == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + offset}"
    return f"{endpoint}-{offset}"


def data_parallel_configs(config: EngineConfig, size: int, threads_per_engine: int | None) -> list[EngineConfig]:
    """The configs of ``size`` engines sharing one machine: each gets its rank, its own KV-event
    ports and ``threads_per_engine`` threads (default: the cores split evenly, at least one)."""
    threads = threads_per_engine or max(1, (os.cpu_count() or 1) // size)
    return [
        dataclasses.replace(
            config, data_parallel_rank=rank, num_threads=threads,
            kv_events_endpoint=offset_endpoint(config.kv_events_endpoint, rank),
            kv_events_replay_endpoint=offset_endpoint(config.kv_events_replay_endpoint, rank),
        )
        for rank in range(size)
    ]


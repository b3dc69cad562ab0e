"""Flags that steer a command rather than fill a settings record: vLLM's serve flags that map to no
setting of ours, the JSON-object flags that expand into several engine fields, ``--simulate``,
``--ray`` and the ``--config`` file. Declared like the settings (one field each)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tokenline.setting_field import (
    API_COMMANDS, ENGINE_COMMANDS, FLEET, KV_CACHE, LIMITED, MODEL, NO_EFFECT, OBSERVABILITY, SERVE, SERVER,
    SIMULATION, SPECULATIVE, VLLM, WIRED, setting,
)
from tokenline.settings.speculative_config import ServeArgsError, speculative_config_fields

_SERVE = frozenset({SERVE})


def _single(what: str) -> Any:
    def refuse(value: Any) -> str | None:
        return None if value in (None, 1) else f"tokenline runs {what}; only 1 is supported, got {value}"
    return refuse


def _refuse_max_logprobs(value: Any) -> str | None:
    if value is None or value <= 20:
        return None
    return f"at most 20 logprobs per token are returned (the OpenAI API's limit); got {value}"


def _refuse_executor(value: Any) -> str | None:
    if value in (None, "mp", "uni"):
        return None
    return f"executor backend {value!r} is not supported: tokenline runs one engine process"


def _refuse_speculative_config(value: Any) -> str | None:
    if value is None:
        return None
    try:
        speculative_config_fields(value)
    except ServeArgsError as exc:
        return str(exc).removeprefix("--speculative-config: ")
    return None


@dataclass
class CommandOptions:
    config: str | None = setting(
        None, "--config", group=SERVER, commands=API_COMMANDS, metavar="FILE.yaml",
        help="read flags from a YAML mapping of flag names without dashes (port: 8001, kv-cache-memory: 4), as "
             "vLLM's --config; flags on the command line override the file")
    model_option: str | None = setting(None, "--model", group=MODEL, commands=API_COMMANDS, dest="model_option",
                                       metavar="MODEL", vllm=WIRED,
                                       help="the model directory or .gguf file, as the positional argument")
    enable_auto_tool_choice: bool = setting(
        False, "--enable-auto-tool-choice", group=MODEL, commands=API_COMMANDS, action="store_true", vllm=WIRED,
        help="needs --tool-call-parser, as in vLLM (which already lets the model choose tools here)")
    disable_log_requests: bool = setting(False, "--disable-log-requests", group=OBSERVABILITY,
                                         commands=API_COMMANDS, action="store_true", vllm=WIRED,
                                         help="no log line per finished request")
    disable_uvicorn_access_log: bool = setting(False, "--disable-uvicorn-access-log", group=OBSERVABILITY,
                                               commands=API_COMMANDS, action="store_true", vllm=WIRED,
                                               help="no access log line per HTTP request")
    kv_events_config: str | None = setting(
        None, "--kv-events-config", group=KV_CACHE, commands=ENGINE_COMMANDS, metavar="JSON",
        help='publish KV cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
             '"endpoint": "tcp://127.0.0.1:5557"}\'')
    speculative_config: str | None = setting(
        None, "--speculative-config", group=SPECULATIVE, commands=API_COMMANDS, vllm=LIMITED,
        refuse=_refuse_speculative_config, idle=lambda v: False,
        help="JSON: method ngram, suffix or mtp (qwen3_next_mtp, qwen3_5_mtp alike), num_speculative_tokens, "
             "prompt_lookup_max/min, suffix_decoding_max_tree_depth/max_spec_factor/min_token_prob, as "
             "--speculative and its flags; draft-model methods are refused")
    simulate: str | None = setting(
        None, "--simulate", group=SIMULATION, commands=_SERVE, metavar="PROFILE.json",
        help="a simulated replica: the real scheduler and KV cache with placeholder tokens, each step sleeping "
             "the time this profile (tokenline bench calibrate) predicts; no model is loaded")
    simulate_speed: float = setting(1.0, "--simulate-speed", group=SIMULATION, commands=_SERVE, type=float,
                                    metavar="X", help="with --simulate: run X times faster than the profile predicts")
    ray: bool = setting(False, "--ray", group=FLEET, commands=_SERVE, action="store_true",
                        help="run the engines as Ray Serve replicas (pip install 'tokenline[ray]'); this process "
                             "keeps the HTTP API and the gateway, Ray Serve's router applies --routing-policy")
    enable_chunked_prefill: bool | None = setting(
        None, "--enable-chunked-prefill", group=VLLM, commands=API_COMMANDS, action=argparse.BooleanOptionalAction,
        vllm=LIMITED, idle=lambda v: v is False,
        help="prefill is always chunked (within --max-num-batched-tokens); turning it off has no effect")
    tensor_parallel_size: int | None = setting(
        None, "--tensor-parallel-size", "-tp", group=VLLM, commands=API_COMMANDS, type=int, vllm=LIMITED,
        refuse=_single("one engine on one device"), idle=lambda v: v == 1,
        help="one engine on one device: 1 changes nothing, more is refused")
    pipeline_parallel_size: int | None = setting(
        None, "--pipeline-parallel-size", "-pp", group=VLLM, commands=API_COMMANDS, type=int, vllm=LIMITED,
        refuse=_single("one engine on one device"), idle=lambda v: v == 1,
        help="one engine on one device: 1 changes nothing, more is refused")
    distributed_executor_backend: str | None = setting(
        None, "--distributed-executor-backend", group=VLLM, commands=API_COMMANDS, vllm=LIMITED,
        choices=["mp", "uni", "ray", "external_launcher"], refuse=_refuse_executor, idle=lambda v: True,
        help="one engine process: mp / uni change nothing, ray is refused")
    max_logprobs: int | None = setting(
        None, "--max-logprobs", group=VLLM, commands=API_COMMANDS, type=int, vllm=LIMITED,
        refuse=_refuse_max_logprobs, idle=lambda v: v < 20,
        help="top logprobs are capped at 20 (OpenAI's limit): a lower cap is not enforced, a higher one refused")
    gpu_memory_utilization: float | None = setting(
        None, "--gpu-memory-utilization", group=VLLM, commands=API_COMMANDS, type=float, vllm=NO_EFFECT,
        help="the KV cache gets --kv-cache-memory GiB instead")
    swap_space: float | None = setting(None, "--swap-space", group=VLLM, commands=API_COMMANDS, type=float,
                                       vllm=NO_EFFECT, help="a preempted request is recomputed, never swapped")
    cpu_offload_gb: float | None = setting(None, "--cpu-offload-gb", group=VLLM, commands=API_COMMANDS, type=float,
                                           vllm=NO_EFFECT, help="weights already live in CPU memory")
    enforce_eager: bool = setting(False, "--enforce-eager", group=VLLM, commands=API_COMMANDS, action="store_true",
                                  vllm=NO_EFFECT, help="there are no CUDA graphs to turn off")
    trust_remote_code: bool = setting(False, "--trust-remote-code", group=VLLM, commands=API_COMMANDS,
                                      action="store_true", vllm=NO_EFFECT,
                                      help="no model code is ever downloaded or run")
    download_dir: str | None = setting(None, "--download-dir", group=VLLM, commands=API_COMMANDS, vllm=NO_EFFECT,
                                       help="nothing is downloaded; see `tokenline import`")
    disable_log_stats: bool = setting(False, "--disable-log-stats", group=VLLM, commands=API_COMMANDS,
                                      action="store_true", vllm=NO_EFFECT,
                                      help="there is no periodic stats log (see /metrics)")


@dataclass
class RayOptions:
    """``serve --ray``'s flags, named as ``RayServeSettings``' fields (router/ray_serve.py, which
    needs Ray installed)."""

    num_replicas: int = setting(1, "--num-replicas", group=FLEET, commands=_SERVE, type=int,
                                help="with --ray: engine replicas")
    address: str | None = setting(None, "--ray-address", group=FLEET, commands=_SERVE,
                                  help="with --ray: an existing cluster (auto, host:port, ray://host:port); default: "
                                       "start a local one")
    min_replicas: int | None = setting(None, "--min-replicas", group=FLEET, commands=_SERVE, type=int,
                                       help="with --ray --max-replicas: autoscaling floor")
    max_replicas: int | None = setting(None, "--max-replicas", group=FLEET, commands=_SERVE, type=int,
                                       help="with --ray: autoscale up to this many replicas on ongoing requests")
    target_ongoing_requests: float | None = setting(
        None, "--target-ongoing-requests", group=FLEET, commands=_SERVE, type=float,
        help="with --ray --max-replicas: ongoing requests per replica the autoscaler aims for")

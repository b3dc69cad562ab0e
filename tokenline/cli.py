"""The ``tokenline`` command: serve, import a model, generate, benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from tokenline.engine.client import RestartPolicy
from tokenline.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, parse_kv_events_config
from tokenline.frontend.reasoning import REASONING_FORMATS
from tokenline.frontend.tool_parsers import TOOL_CALL_FORMATS
from tokenline.gateway.cache_scope import PREFIX_CACHE_SCOPES
from tokenline.serve_args import (
    add_vllm_args,
    check_model_argument,
    check_tokenizer_argument,
    check_vllm_args,
    no_effect_warning,
    quiet_request_logs,
    speculative_config_overrides,
)

if TYPE_CHECKING:
    from tokenline.api.app import ServerSettings
    from tokenline.sim.replicas import FleetConfig
    from tokenline.router.ray_serve import RayServeSettings


class CommandLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where the flags are listed, not the usage
    (serve's runs to pages and buries the error under it). Subcommand parsers are of this class too
    and say which subcommand the error is in."""

    commands: argparse._SubParsersAction | None = None

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        self.commands = super().add_subparsers(**kwargs)
        return self.commands

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def command_parser(self, args: argparse.Namespace) -> CommandLineParser:
        """The parser of the (sub)command ``args`` were parsed for."""
        parser = self
        while parser.commands is not None and getattr(args, parser.commands.dest, None) in parser.commands.choices:
            parser = parser.commands.choices[getattr(args, parser.commands.dest)]
        return parser


def add_engine_args(parser: argparse.ArgumentParser, quantization: bool = True) -> None:
    """Engine flags, named like vLLM's. ``quantization=False``: serve takes ``--quantization`` and
    ``--kv-cache-dtype`` with vLLM's other flags (serve_args.VLLM_FLAGS, where other values are
    refused by name)."""
    d = EngineConfig()
    if quantization:
        parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                            help="weight-only quantization of the linear layers to ggml's blocks (the head Q8_0)")
        parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                            help="the KV cache's dtype: auto (--dtype) or bfloat16 (half a float32 model's KV)")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations dtype (auto = bfloat16)")
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    parser.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory_gib,
                        help="GiB of memory for the KV cache (like VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                        help="token budget of one step (prefill chunks + decodes)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching, help="reuse cached prompt prefixes (on by default)")
    parser.add_argument("--prefix-cache-resident-memory", type=float, metavar="GIB",
                        default=d.prefix_cache_resident_memory_gib,
                        help="freed prefixes stay cached in fresh KV memory until this many GiB of the pool "
                             "were touched; past it they are evicted before touching more, so resident KV is "
                             "at most this or the peak in use (default %(default)s)")
    parser.add_argument("--prefix-cache-fills-pool", action=argparse.BooleanOptionalAction,
                        default=d.prefix_cache_fills_pool,
                        help="overrides --prefix-cache-resident-memory: keep freed prefixes cached until the "
                             "whole KV pool is in use (more prefix hits, all of --kv-cache-memory resident in "
                             "the end); --no-... evicts them before touching new memory, so resident KV is "
                             "the peak in use")
    parser.add_argument("--hybrid-state-checkpoint-interval", type=int, default=None, metavar="TOKENS",
                        help="hybrid models: keep a recurrent-state checkpoint every TOKENS tokens, a multiple "
                             "of --block-size (default: 4 blocks), besides each prompt's end")
    parser.add_argument("--hybrid-state-checkpoints", type=int, default=None, metavar="N",
                        help="hybrid models: state checkpoint slots (default: 2 x --max-num-seqs, at most half "
                             "of --kv-cache-memory); 0 turns prefix caching off for them")
    parser.add_argument("--speculative", default=None, choices=["ngram", "suffix", "mtp"],
                        help="speculative decoding for greedy requests; ngram: drafts looked up in the context; "
                             "suffix: drafts from a suffix tree of the request's tokens, adaptive length; "
                             "mtp: drafts from the checkpoint's own multi-token-prediction head (hybrid Qwen3.5)")
    parser.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                        help="most draft tokens per request and step")
    parser.add_argument("--prompt-lookup-max", type=int, default=d.prompt_lookup_max,
                        help="longest n-gram the ngram proposer matches")
    parser.add_argument("--prompt-lookup-min", type=int, default=d.prompt_lookup_min,
                        help="shortest n-gram the ngram proposer matches")
    parser.add_argument("--suffix-decoding-max-tree-depth", type=int, default=d.suffix_decoding_max_tree_depth,
                        help="suffix proposer: deepest substring the tree holds (match + draft)")
    parser.add_argument("--suffix-decoding-max-spec-factor", type=float, default=d.suffix_decoding_max_spec_factor,
                        help="suffix proposer: drafts at most this factor x the match length")
    parser.add_argument("--suffix-decoding-min-token-prob", type=float, default=d.suffix_decoding_min_token_prob,
                        help="suffix proposer: stop drafting where the estimated probability falls below this")
    parser.add_argument("--grammar-cache-bytes", type=int, default=d.grammar_cache_bytes, metavar="BYTES",
                        help="memory the compiled structured-output grammars may hold, least recently used "
                             f"evicted first (default {d.grammar_cache_bytes >> 20} MiB; 0 keeps none)")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help='publish KV cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
                             '"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}\'')


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    """How a fleet (--data-parallel-size engines, a router's upstreams) picks a replica per request."""
    parser.add_argument("--routing-policy", default=None, metavar="NAME",
                        help="round_robin, least_load, prefix (affinity from the prompts routed) or kv_events "
                             "(affinity from the replicas' KV events; the default)")
    parser.add_argument("--session-affinity", action="store_true",
                        help="requests with the same `user` go to the same replica while it is up")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_resident_memory_gib=getattr(args, "prefix_cache_resident_memory",
                                                 EngineConfig.prefix_cache_resident_memory_gib),
        prefix_cache_fills_pool=getattr(args, "prefix_cache_fills_pool", None),
        hybrid_state_checkpoint_interval=getattr(args, "hybrid_state_checkpoint_interval", None),
        hybrid_state_checkpoints=getattr(args, "hybrid_state_checkpoints", None),
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        suffix_decoding_max_tree_depth=args.suffix_decoding_max_tree_depth,
        suffix_decoding_max_spec_factor=args.suffix_decoding_max_spec_factor,
        suffix_decoding_min_token_prob=args.suffix_decoding_min_token_prob,
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None) or "auto",
        grammar_cache_bytes=args.grammar_cache_bytes,
        **(parse_kv_events_config(args.kv_events_config) if getattr(args, "kv_events_config", None) else {}),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from tokenline.api.app import serve

    try:
        settings, idle = serve_settings_from_args(args)
    except ValueError as exc:  # a value tokenline cannot honour: one line, no traceback
        print(f"tokenline serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_request_logs(args)
    if idle:
        logging.getLogger("tokenline.serve").warning(no_effect_warning(idle))
    return serve(settings)


def cmd_router(args: argparse.Namespace) -> int:
    """``tokenline router``: serve's API process (gateway, text work) over remote upstreams."""
    import logging

    from tokenline.api.app import serve

    try:
        settings, idle = router_settings_from_args(args)
    except ValueError as exc:
        print(f"tokenline router: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call and health check
    quiet_request_logs(args)
    if idle:
        logging.getLogger("tokenline.serve").warning(no_effect_warning(idle))
    return serve(settings)


def router_settings_from_args(args: argparse.Namespace) -> tuple[ServerSettings, list[str]]:
    """``router``'s flags as serve's settings: what the router lacks (engine flags) takes serve's
    defaults, so one mapping (``serve_settings_from_args``) serves both."""
    from tokenline.router.data_parallel import build_policy
    from tokenline.router.remote_fleet import default_router_policy, parse_upstreams

    if (args.data_parallel_size or 1) > 1:
        raise ValueError("--data-parallel-size is serve's; a router's replicas are its --upstream servers")
    if args.unhealthy_after < 1:
        raise ValueError(f"--unhealthy-after must be at least 1, got {args.unhealthy_after}")
    specs = parse_upstreams(args.upstream)
    build_policy(args.routing_policy or default_router_policy(specs))  # an unknown name fails here
    for name, value in vars(build_parser().parse_args(["serve"])).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    settings, idle = serve_settings_from_args(args)
    settings.upstreams = list(args.upstream)
    settings.upstream_api_key = args.upstream_api_key
    settings.health_interval = args.health_interval
    settings.unhealthy_after = args.unhealthy_after
    return settings, idle


def serve_settings_from_args(args: argparse.Namespace) -> tuple[ServerSettings, list[str]]:
    """The server's settings from ``serve``'s flags, and the accepted flags that have no effect
    here. Raises ``ValueError`` (one-line message) for a value tokenline cannot honour."""
    from tokenline.api.app import ServerSettings, door_policy
    from tokenline.frontend.chat_template import load_chat_template
    from tokenline.model.config import load_generation_config

    idle = check_vllm_args(args)
    check_model_argument(args.model)
    check_tokenizer_argument(args.tokenizer)
    if args.generation_config not in ("auto", "vllm"):
        load_generation_config(args.generation_config, Path())  # a folder without the file fails now
    settings = ServerSettings(
        model=args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,  # vLLM's variable, as a fallback
        keys_file=args.keys,
        redis_url=args.redis_url,
        usage_db=args.usage_db,
        prices_file=args.prices,
        log_prompts=args.log_prompts,
        content_filter=args.content_filter,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        request_timeout=args.request_timeout or None,
        shutdown_timeout=args.shutdown_timeout,
        max_request_bytes=args.max_request_bytes,
        max_messages=args.max_messages,
        max_tokens_cap=args.max_tokens_cap,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
        generation_config=args.generation_config,
        uvicorn_log_level=args.uvicorn_log_level,
        engine=dataclasses.replace(engine_config_from_args(args), seed=args.seed, tokenizer=args.tokenizer,
                                   **speculative_config_overrides(args)),
        engine_restart=restart_policy_from_args(args),
        data_parallel_size=args.data_parallel_size or 1,
        threads_per_engine=args.threads_per_engine,
        routing_policy=args.routing_policy,
        session_affinity=args.session_affinity,
        metrics_auth=args.metrics_auth,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_tenant_labels=args.metrics_tenant_labels,
        header_timeout=args.header_timeout or None,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections or None,
        filter_holdback=args.filter_holdback,
        max_tokenize_bytes=args.max_tokenize_bytes,
        traces_per_tenant=args.traces_per_tenant,
        max_pending_connections=args.max_pending_connections or None,
        max_pending_per_address=args.max_pending_per_address or None,
        body_timeout=args.body_timeout or None,
        body_min_rate=args.body_min_rate or None,
        prefix_cache_scope=args.prefix_cache_scope,
    )
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise ValueError(f"--num-kv-blocks must be at least 1, got {args.num_kv_blocks}")
    settings.engine.num_kv_blocks = args.num_kv_blocks
    for flag in ("max_connections", "max_pending_connections", "max_pending_per_address", "header_timeout",
                 "body_timeout", "body_min_rate"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be 0 (none) or more, got {getattr(args, flag)}")
    settings.engine.validate()  # a bad engine flag is one line here, not a dead engine process later
    if settings.engine.speculative == "mtp" and not args.simulate:
        from tokenline.model.model_store import resolve_model
        from tokenline.model.mtp_checkpoint import check_mtp_checkpoint

        check_mtp_checkpoint(resolve_model(args.model, progress=False))  # a model without an MTP head: one line
    if args.simulate:
        from tokenline.sim.profile import Profile
        from tokenline.sim.replica import SimulatedReplica

        settings.engine.core_factory = SimulatedReplica(Profile.read(args.simulate), args.simulate_speed)
    elif args.simulate_speed != 1.0:
        raise ValueError("--simulate-speed needs --simulate PROFILE.json")
    if settings.threads_per_engine is not None and settings.threads_per_engine < 1:
        raise ValueError(f"--threads-per-engine must be at least 1, got {settings.threads_per_engine}")
    if settings.data_parallel_size > 1:
        from tokenline.router.data_parallel import DEFAULT_DATA_PARALLEL_POLICY, build_policy

        build_policy(settings.routing_policy or DEFAULT_DATA_PARALLEL_POLICY)  # an unknown name fails here
    if args.ray:
        settings.ray = ray_settings_from_args(args)
    elif args.num_replicas != 1 or args.ray_address or args.max_replicas is not None or args.min_replicas is not None:
        raise ValueError("--num-replicas, --ray-address, --min-replicas and --max-replicas need --ray")
    door_policy(settings)  # contradictory access flags (e.g. --metrics-auth admin without keys) fail here
    return settings, idle


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """``serve --ray``: the engines as Ray Serve replicas (tokenline/router/ray_serve.py)."""
    parser.add_argument("--ray", action="store_true",
                        help="run the engines as Ray Serve replicas (pip install 'tokenline[ray]'); this process "
                             "keeps the HTTP API and the gateway, Ray Serve's router applies --routing-policy")
    parser.add_argument("--num-replicas", type=int, default=1, help="with --ray: engine replicas")
    parser.add_argument("--ray-address", default=None,
                        help="with --ray: an existing cluster (auto, host:port, ray://host:port); default: start a "
                             "local one")
    parser.add_argument("--min-replicas", type=int, default=None, help="with --ray --max-replicas: autoscaling floor")
    parser.add_argument("--max-replicas", type=int, default=None,
                        help="with --ray: autoscale up to this many replicas on ongoing requests")
    parser.add_argument("--target-ongoing-requests", type=float, default=None,
                        help="with --ray --max-replicas: ongoing requests per replica the autoscaler aims for")


def ray_settings_from_args(args: argparse.Namespace) -> RayServeSettings:
    """``--ray``'s settings; ``ValueError`` for a combination Ray Serve cannot run."""
    if (args.data_parallel_size or 1) > 1:
        raise ValueError("--ray and --data-parallel-size exclude each other: use --num-replicas")
    if args.kv_events_config and parse_kv_events_config(args.kv_events_config).get("kv_events_endpoint"):
        # Every replica would bind the same port; Ray Serve's routing stats carry their blocks instead.
        raise ValueError("--kv-events-config with an endpoint does not work with --ray: replicas report their "
                         "cached blocks to the router through Ray Serve (use --routing-policy kv_events)")
    try:
        from tokenline.router.ray_serve import DEFAULT_RAY_POLICY, RayServeSettings, resolve_policy
    except ImportError as exc:
        raise ValueError(f"--ray needs Ray Serve: pip install 'tokenline[ray]' ({exc})") from None
    policy = args.routing_policy or DEFAULT_RAY_POLICY
    resolve_policy(policy)  # an unknown name fails here, not in Ray Serve's router
    return RayServeSettings(
        num_replicas=args.num_replicas, address=args.ray_address, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
        routing_policy=policy, session_affinity=args.session_affinity, threads_per_engine=args.threads_per_engine,
    )


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy | None:
    if args.engine_restart_max == 0:
        return None  # a dead engine stays dead (the server keeps answering 503)
    return RestartPolicy(args.engine_restart_max, args.engine_restart_window, args.engine_restart_backoff,
                         args.engine_restart_backoff_max)


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from tokenline.model.config import ModelConfig
    from tokenline.model.model_store import resolve_model
    from tokenline.model.plan import plan_memory

    source = Path(args.model) if args.model else None
    if source is not None and source.suffix == ".json":
        config = ModelConfig.from_dict(json.loads(source.read_text()))  # a bare config: no weights needed
    else:
        config = ModelConfig.from_dir(resolve_model(args.model))
    dtype_size = 4 if args.dtype == "float32" else 2
    print(plan_memory(config, args.memory, args.seq_len, dtype_size, args.hybrid_state_checkpoints).format())
    return 0


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from tokenline.frontend.qwen_vocab import build_qwen_tokenizer
    from tokenline.model.random_models import make_qwen3_5_tiny

    makers = {"qwen3.5-tiny": make_qwen3_5_tiny}
    makers[args.kind](Path(args.out), seed=args.seed)
    build_qwen_tokenizer(Path(args.out))  # the real Qwen3.5 vocabulary, so the model can be served
    print(args.out)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from tokenline.model.model_store import resolve_model

    print(resolve_model(args.model))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams

    llm = LLM(args.model, **asdict(engine_config_from_args(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate(args.prompt, params)
    print(outputs[0].outputs[0].text)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from tokenline.frontend.processor import PromptError
    from tokenline.llm import LLM
    from tokenline.sampling_params import MAX_LOGPROBS
    from tokenline.trace_walk import load_prices, render, walk

    try:
        prices = load_prices(args.prices)
    except (OSError, ValueError) as exc:
        print(f"error: --prices: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.top_candidates <= MAX_LOGPROBS or args.repeat < 1 or args.max_tokens < 1:
        print(f"error: --top-candidates must be in [0, {MAX_LOGPROBS}], --repeat and --max-tokens at least 1",
              file=sys.stderr)
        return 2
    llm = LLM(args.model, **asdict(engine_config_from_args(args)))
    try:
        trace = walk(llm, args.question, system=args.system, max_tokens=args.max_tokens,
                     temperature=args.temperature, top_candidates=args.top_candidates, stop=args.stop or (),
                     repeat=args.repeat, prices=prices)
    except (PromptError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(trace.to_dict(), indent=2))
    else:
        from rich.console import Console

        render(trace, Console())
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from tokenline.bench.throughput import format_table, repeat_prompts, run_hf, run_tokenline, synthetic_prompts
    from tokenline.frontend.tokenizer import Tokenizer
    from tokenline.model.model_store import resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    if args.workload == "repeat":
        prompts = repeat_prompts(args.num_prompts, args.input_len, tokenizer, args.seed)
    else:
        prompts = synthetic_prompts(
            args.num_prompts, args.input_len, tokenizer.vocab_size, set(tokenizer.all_special_ids), args.seed
        )
    base = engine_config_from_args(args)
    if args.structured_json_schema:
        from tokenline.bench.throughput import run_tokenline_structured

        schema = json.loads(Path(args.structured_json_schema).read_text())
        results = []
        for dtype in args.dtypes or [base.dtype]:
            config = EngineConfig(**{**asdict(base), "dtype": dtype})
            bench = run_tokenline_structured(model_dir, prompts, args.output_len, config, schema)
            results += [bench.unconstrained, bench.constrained]
            print(format_table([bench.unconstrained, bench.constrained]))
            print(bench.summary())
        if args.output_json:
            Path(args.output_json).write_text(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    speculative = [None, base.speculative or "ngram"] if args.compare_speculative else [base.speculative]
    results = []
    for dtype in args.dtypes or [base.dtype]:
        for spec in speculative:
            config = EngineConfig(**{**asdict(base), "dtype": dtype, "speculative": spec})
            results.append(run_tokenline(model_dir, prompts, args.output_len, config))
            print(format_table(results[-1:]), file=sys.stderr)
    if args.hf:
        for dtype in args.dtypes or ["bfloat16"]:
            hf_dtype = "bfloat16" if dtype == "auto" else dtype
            results.append(run_hf(model_dir, prompts, args.output_len, hf_dtype, args.hf_batch_size))
            print(format_table(results[-1:]), file=sys.stderr)
    print(format_table(results))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from tokenline.bench.serve import BenchServeConfig, load_dataset_prompts, run_bench_serve

    try:
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as e:
        print(f"tokenline bench serve: --extra-body is not valid JSON: {e}", file=sys.stderr)
        return 2
    if not isinstance(extra_body, dict):
        print("tokenline bench serve: --extra-body must be a JSON object", file=sys.stderr)
        return 2
    workload = "dataset" if args.dataset_path else args.workload
    endpoint = args.endpoint or ("chat" if workload == "multiturn" else "completions")
    try:
        config = BenchServeConfig(
            base_url=args.base_url, concurrency=args.concurrency, num_prompts=args.num_prompts,
            input_len=args.input_len, output_len=args.output_len, seed=args.seed, model=args.model,
            api_key=args.api_key, endpoint=endpoint, tokenizer_dir=args.tokenizer_dir,
            shared_prefix_len=args.shared_prefix_len, timeout=args.timeout,
            extra_body=extra_body, workload=workload, dataset_path=args.dataset_path, num_groups=args.num_groups,
            num_conversations=args.num_conversations, turns=args.turns, system_prompt_len=args.system_prompt_len,
            replica_metrics_urls=args.replica_metrics_url or [], metrics_api_key=args.metrics_api_key,
        )
        if config.dataset_path is not None:
            load_dataset_prompts(config.dataset_path, 1)  # a bad file fails here, in one line
    except (ValueError, OSError) as e:
        print(f"tokenline bench serve: {e}", file=sys.stderr)
        return 2
    report = asyncio.run(run_bench_serve(config))
    print(report.format_table())
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.failed == 0 else 1


def cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from tokenline.model.model_store import resolve_model
    from tokenline.sim.calibrate import calibrate

    if args.request_overhead_ms is not None and args.request_overhead_ms < 0:
        print("tokenline bench calibrate: --request-overhead-ms must be >= 0", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model)
    except FileNotFoundError as e:
        print(f"tokenline bench calibrate: {e}", file=sys.stderr)
        return 2
    overhead = None if args.request_overhead_ms is None else args.request_overhead_ms / 1000
    profile = calibrate(model_dir, args.dtype, request_overhead_s=overhead, server_run=args.server_run)
    m = profile.step_model
    b_fused = m.b if m.b_fused is None else m.b_fused
    print(f"step_s = {m.a * 1e3:.3f} ms + {m.b * 1e3:.4f} ms/prefill token ({b_fused * 1e3:.4f} in the one-call layer) "
          f"+ {m.c * 1e3:.3f} ms/decode seq + {m.e * 1e3:.3f} ms x log2(1 + decode seqs) "
          + "".join(f"+ {h * 1e3:.3f} ms/decode seq past {k} " for k, h in zip(m.knots, m.hinges))
          + (f"+ {m.prefill_hinge * 1e3:.4f} ms/prefill token past {m.prefill_knot} " if m.prefill_knot else "")
          + f"+ {m.d * 1e6:.4f} us/attended context token + {m.q * 1e6:.4f} us/prefill query-key pair "
          f"({m.q_fused * 1e6:.4f} in the one-call layer) + {m.f * 1e3:.3f} ms off the fused decode path  "
          f"(fit rms {m.residual_rms_rel * 100:.1f} %, {m.residual_rms_s * 1e3:.2f} ms, over "
          f"{profile.num_steps} steps; {profile.model}, {profile.dtype})")
    if profile.server_steps:
        print(f"in a server: step x {profile.step_scale:.3f} + {profile.step_overhead_s * 1e3:.2f} ms "
              f"(over {profile.server_steps} steps), {profile.request_overhead_s * 1e3:.1f} ms per request")
    profile.write(args.output)
    print(f"profile written to {args.output}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from tokenline.engine.engine_core import RequestRejected
    from tokenline.sim.profile import Profile, ProfileError
    from tokenline.sim.replicas import format_replicas, simulate_replicas
    from tokenline.sim.simulate import SimConfig, sim_target, simulate

    try:
        profile = Profile.read(args.profile)
        overhead = None if args.request_overhead_ms is None else args.request_overhead_ms / 1000
        config = SimConfig(
            concurrency=args.concurrency, num_prompts=args.num_prompts, input_len=args.input_len,
            output_len=args.output_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gib=args.kv_cache_memory,
            seed=args.seed, request_overhead_s=overhead, model_config=args.model_config, machine=args.machine,
            num_kv_blocks=args.num_kv_blocks,
        )
        target = sim_target(profile, config)
        if args.replicas != 1 or args.workload != "random" or args.shared_prefix_len:
            report = simulate_replicas(profile, config, fleet_config_from_args(args), target)
        else:
            report = simulate(profile, config, target)
    except (ProfileError, ValueError, RequestRejected) as e:  # RequestRejected: a workload that never fits
        print(f"tokenline simulate: {e}", file=sys.stderr)
        return 2
    print(target.describe())
    print(report.format_table())
    if args.replicas > 1:
        print(format_replicas(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report.to_dict(), indent=2))
    return 0


def fleet_config_from_args(args: argparse.Namespace) -> FleetConfig:
    """``simulate --replicas``'s fleet and workload flags (ValueError: a value out of range)."""
    from tokenline.router.data_parallel import DEFAULT_DATA_PARALLEL_POLICY
    from tokenline.sim.replicas import FleetConfig

    return FleetConfig(
        replicas=args.replicas, routing_policy=args.routing_policy or DEFAULT_DATA_PARALLEL_POLICY,
        session_affinity=args.session_affinity, workload=args.workload, shared_prefix_len=args.shared_prefix_len,
        num_groups=args.num_groups, num_conversations=args.num_conversations, turns=args.turns,
        system_prompt_len=args.system_prompt_len, tokenizer_dir=args.tokenizer_dir,
    )


def cmd_bench_roofline(args: argparse.Namespace) -> int:
    from tokenline.bench.roofline import RooflineConfig, parse_size, run_roofline, write_json

    try:
        bandwidth_bytes = parse_size(args.bandwidth_bytes)
    except ValueError as e:
        print(f"tokenline bench roofline: --bandwidth-bytes: {e}", file=sys.stderr)
        return 2
    config = RooflineConfig(
        model=args.model, dtype=args.dtype, batch_sizes=args.batch_sizes, prompt_len=args.prompt_len,
        steps=args.steps, warmup_steps=args.warmup_steps, bandwidth_bytes=bandwidth_bytes,
        repeats=args.repeats, matmul_size=args.matmul_size, seed=args.seed,
    )
    report = run_roofline(config, log=lambda line: print(line, file=sys.stderr))
    print(report.format_table())
    if args.output_json:
        write_json(report, Path(args.output_json))
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    from tokenline.gateway.ledger import usage_command

    return usage_command(args.db, args.since, args.until, args.tenant, args.json)


def cmd_top(args: argparse.Namespace) -> int:
    from tokenline.top import top_command

    return top_command(args.url, args.api_key, args.interval, args.once, args.json)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _filter_holdback(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected auto or a number of characters (0 or more), got {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def cmd_keys_add(args: argparse.Namespace) -> int:
    from tokenline.gateway.keys import KeyFileError, add_key

    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    try:
        key = add_key(args.file, args.name, models=models, admin=args.admin, requests_per_minute=args.rpm,
                      tokens_per_minute=args.tpm, max_concurrent=args.max_concurrent,
                      daily_tokens=args.daily_tokens)
    except (KeyFileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # The key alone on stdout (so `KEY=$(tokenline keys add ...)` works); the note on stderr.
    print(key)
    print(f"Added tenant {args.name!r} to {args.file}. Store this key now: it cannot be shown again "
          "(the file keeps only its SHA-256).", file=sys.stderr)
    return 0


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """The API process's flags (address, keys, limits, ledger, metrics, timeouts): serve and router share them."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients use, as vLLM's aliases; the first is reported (default: the model argument)")
    p.add_argument("--api-key", default=None,
                   help="require this key as a Bearer token on every endpoint but /health, /ping and /live "
                        "(default: $VLLM_API_KEY, as vLLM)")
    p.add_argument("--keys", default=None, help="TOML file of tenants (hashed keys, models, limits); see README")
    p.add_argument("--redis-url", default=None, help="share rate-limit state between servers through Redis")
    p.add_argument("--usage-db", default=None, help="SQLite usage ledger (default: $TOKENLINE_HOME/usage.sqlite3)")
    p.add_argument("--prices", default=None, help="TOML price table, USD per million tokens per model")
    p.add_argument("--log-prompts", action="store_true", help="include user text in logs (off by default)")
    p.add_argument("--content-filter", default=None, metavar="FILE",
                   help="safety filters (TOML or JSON [[content_filter]] tables) for tenants without their own")
    p.add_argument("--filter-holdback", type=_filter_holdback, default=None, metavar="auto|N",
                   help="characters of output a stream holds back for the output filters (default auto: the "
                        "longest blocklist word less one, so a listed word is never streamed in part)")
    p.add_argument("--traces-per-tenant", type=_positive_int, default=10_000,
                   help="request traces kept per tenant (refused requests: a tenth as many, apart)")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_FORMATS),
                   help="split <think>...</think> into the message's reasoning_content (deepseek_r1: the answer "
                        "starts in the thought, only </think> may appear)")
    p.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_FORMATS),
                   help="turn the model's tool calls into OpenAI tool_calls (enables `tools`): hermes/qwen3 "
                        "<tool_call>{...}</tool_call>, llama3_json {\"name\": ..., \"parameters\": ...}, "
                        "pythonic [f(x=1)]")
    p.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get a 413")
    p.add_argument("--max-tokenize-bytes", type=_positive_int, default=1024 * 1024,
                   help="larger /tokenize and /detokenize bodies get a 413 (at most --max-request-bytes)")
    p.add_argument("--max-messages", type=int, default=1024, help="most messages in one chat request")
    p.add_argument(
        "--max-tokens-cap", type=int, default=None,
        help="largest max_tokens a request may ask for; also the max_tokens of requests that omit it",
    )
    p.add_argument(
        "--allow-special-tokens-in-content", action="store_true",
        help="tokenize special-token strings (<|im_end|>, ...) in message content and text prompts as special "
        "tokens; by default user text stays text",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (0 = no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--metrics-auth", default=None, choices=["admin", "key", "none"],
                   help="what /metrics needs when keys are configured (default: admin on the API's address, "
                        "none on --metrics-port)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics on this port only (not on --port)")
    p.add_argument("--metrics-host", default=None, help="address of the --metrics-port listener (default: --host)")
    p.add_argument("--metrics-tenant-labels", action="store_true",
                   help="label spend and rate-limit series with tenant names (off: no tenant names on /metrics)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a complete request head, else it is closed (0 = none)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="connections a request was let in on (with keys: a valid key); beyond them a new request "
                        "closes the longest idle or uploading one, or gets a 503 if all are at work (0 = no cap)")
    p.add_argument("--max-pending-connections", type=int, default=256,
                   help="connections that have not yet sent a request let in; beyond them the oldest (older than "
                        "1 s) still awaiting a head are closed (0 = no cap)")
    p.add_argument("--max-pending-per-address", type=int, default=32,
                   help="the same budget per source address (an IPv6 /64 counts as one; 0 = no cap)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive, else 408 and close (0 = none)")
    p.add_argument("--body-min-rate", type=float, default=500.0,
                   help="bytes/s a request body must average after its first 5 s, else 408 and close (0 = none)")
    p.add_argument("--prefix-cache-scope", default="tenant", choices=PREFIX_CACHE_SCOPES,
                   help="who may reuse a cached prompt prefix: tenant (only the tenant whose request cached it) "
                        "or global (every tenant; cached_tokens and the time to the first token then tell one "
                        "tenant whether another sent a prompt)")


def build_parser() -> CommandLineParser:
    parser = CommandLineParser(prog="tokenline", description="LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("model", nargs="?", default=None, help="HF-format directory or .gguf file (default: SmolLM2)")
    add_gateway_args(p)
    r = RestartPolicy()
    p.add_argument("--engine-restart-max", type=int, default=r.max_restarts,
                   help="restarts of a dead engine allowed within --engine-restart-window; one more death "
                        "exits the server with status 3 (0 = never restart)")
    p.add_argument("--engine-restart-window", type=float, default=r.window_s, help="seconds (crash-loop window)")
    p.add_argument("--engine-restart-backoff", type=float, default=r.backoff_base_s,
                   help="seconds before the first restart; doubles with each death in the window")
    p.add_argument("--engine-restart-backoff-max", type=float, default=r.backoff_max_s,
                   help="longest wait before a restart, in seconds")
    p.add_argument("--threads-per-engine", type=int, default=None,
                   help="torch threads of each engine (default: the cores split between --data-parallel-size engines)")
    p.add_argument("--simulate", default=None, metavar="PROFILE.json",
                   help="a simulated replica: the real scheduler and KV cache with placeholder tokens, each step "
                        "sleeping the time this profile (tokenline bench calibrate) predicts; no model is loaded")
    p.add_argument("--simulate-speed", type=float, default=1.0, metavar="X",
                   help="with --simulate: run X times faster than the profile predicts")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks (overrides --kv-cache-memory)")
    add_ray_args(p)
    add_routing_args(p)
    add_engine_args(p, quantization=False)
    add_vllm_args(p)
    p.set_defaults(func=cmd_serve)

    p = commands.add_parser("router", help="the gateway in front of remote tokenline or vLLM servers (--upstream)")
    p.add_argument("--upstream", action="append", default=[], metavar="URL[,kv-events=tcp://H:P[,replay=tcp://H:P]]",
                   help="an upstream server's base URL serving the same model (repeat for each); with kv-events= "
                        "the router reads its KV events (vLLM's ZMQ format) for precise prefix affinity "
                        "(kv-events-bind=tcp://H:P instead: the router listens there, for a vLLM whose publisher "
                        "connects); "
                        "URL,kind=openai[,model=NAME]: an OpenAI-compatible endpoint that takes text only (a hosted "
                        "API), chat and completions forwarded as text (all upstreams of one router share a kind)")
    p.add_argument("--upstream-api-key", default=None,
                   help="Bearer key sent to every upstream (requests, /health, /metrics)")
    p.add_argument("--health-interval", type=_positive_seconds, default=2.0,
                   help="seconds between health checks (and /metrics scrapes) of each upstream")
    p.add_argument("--unhealthy-after", type=int, default=3,
                   help="failed health checks in a row before an upstream gets no more requests "
                        "(a refused connection takes it out at once)")
    add_gateway_args(p)
    add_routing_args(p)
    add_vllm_args(p)
    p.set_defaults(func=cmd_router)

    p = commands.add_parser("plan", help="memory plan: weights, KV per token, state per sequence, sequences that fit")
    p.add_argument("--model", default=None, help="model directory, .gguf file or a config.json (default: SmolLM2)")
    p.add_argument("--memory", type=float, required=True, help="GiB of memory for weights + KV + states")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (prompt + output)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--hybrid-state-checkpoints", type=int, default=0, metavar="N",
                   help="hybrid models: state checkpoint slots to count (prefix caching)")
    p.set_defaults(func=cmd_plan)

    p = commands.add_parser("make-test-model", help="write a tiny random-weight model in HF format (tests, demos)")
    p.add_argument("kind", choices=["qwen3.5-tiny"])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_test_model)

    p = commands.add_parser("import", help="import a model (default: SmolLM2-135M-Instruct) and print its directory")
    p.add_argument("model", nargs="?", default=None,
                   help="HF-format directory, .gguf file, or a packaged model's name (gemma3-270m)")
    p.set_defaults(func=cmd_import)

    p = commands.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user message")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = commands.add_parser("trace", help="walk one chat request through the engine and show every stage")
    p.add_argument("question")
    p.add_argument("--model", default=None)
    p.add_argument("--system", default=None, help="a system message before the question")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-candidates", type=int, default=5, help="the sampler's top-K candidates shown per step")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="run the request N times (a repeat hits the prefix cache)")
    p.add_argument("--prices", default=None, help="TOML price table as for serve (default: zero cost)")
    p.add_argument("--json", action="store_true", help="print the trace as one JSON document")
    add_engine_args(p)
    p.set_defaults(func=cmd_trace)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("throughput", help="offline throughput on synthetic prompts")
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", nargs="+", default=None, choices=["auto", "float32", "bfloat16"],
                   help="run tokenline once per dtype (default: --dtype)")
    p.add_argument("--workload", default="random", choices=["random", "repeat"],
                   help="random token ids, or chats asking to repeat a passage (~input-len tokens) that the "
                        "answer copies, where --speculative ngram helps")
    p.add_argument("--compare-speculative", action="store_true",
                   help="run each dtype without and with speculation (--speculative, default ngram) side by side")
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate on the same prompts")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--structured-json-schema", default=None, metavar="FILE",
                   help="run the workload without and then with this JSON schema on every request (one "
                        "engine), and report output tok/s of both and grammar compile p50/p99")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_bench_throughput)

    p = bench.add_parser("serve", help="load an OpenAI-compatible server with streaming requests")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=1,
                   help="most requests (multiturn: conversations) in flight")
    p.add_argument("--workload", default="random", choices=["random", "multiturn", "dataset"],
                   help="random: --num-prompts prompts of --input-len; multiturn: chats over shared system "
                        "prompts, each turn a fresh user message of --input-len plus the model's earlier answers; "
                        "dataset: the prompts of --dataset-path")
    p.add_argument("--dataset-path", default=None, metavar="JSONL",
                   help='prompts to send, one {"prompt": "..."} a line (vLLM\'s custom dataset); implies '
                        "--workload dataset; --num-prompts of them, cycling")
    p.add_argument("--num-prompts", type=int, default=64, help="random workload: requests")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (multiturn: per user message)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-groups", type=int, default=4, help="multiturn: system prompts, one per group")
    p.add_argument("--num-conversations", type=int, default=16, help="multiturn: conversations over the groups")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--system-prompt-len", type=int, default=512, help="multiturn: tokens of each system prompt")
    p.add_argument("--replica-metrics-url", action="append", default=None, metavar="URL",
                   help="read prefix-cache counters from this replica's /metrics (repeat per replica; "
                        "default: --base-url's)")
    p.add_argument("--metrics-api-key", default=None, help="key for /metrics (default: --api-key)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", default=None, choices=["completions", "chat"],
                   help="completions: token-id prompts, exact length; chat: decoded text, approximate "
                        "(default: completions; multiturn: chat)")
    p.add_argument("--tokenizer-dir", default=None, help="tokenizer for the random ids (default: the default model's)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="leading tokens every prompt shares")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help='fields merged into every request, e.g. \'{"structured_outputs": {"json": {...}}}\'')
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_bench_serve)

    p = bench.add_parser("roofline", help="decode step time against this machine's memory-bandwidth and FLOP limits")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=256, help="random prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--bandwidth-bytes", default="2GiB",
                   help="bandwidth buffer, far larger than the last-level cache (e.g. 2GiB, 64MiB)")
    p.add_argument("--repeats", type=int, default=5, help="runs per bandwidth method and matmul (median)")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n x n matmul peak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_bench_roofline)

    p = bench.add_parser("calibrate", help="fit a step-time profile of the real engine on this machine (for simulate)")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--output", default="profile.json", metavar="PROFILE.json")
    p.add_argument("--request-overhead-ms", type=float, default=None,
                   help="per-request time outside the engine (HTTP, tokenize, detokenize) to store in the profile "
                        "(default: measured by the server run, else 0)")
    p.add_argument("--no-server-run", dest="server_run", action="store_false",
                   help="skip the short real-server run that fits the per-step and per-request server overheads")
    p.set_defaults(func=cmd_bench_calibrate)

    p = commands.add_parser("simulate", help="the real scheduler and KV cache on a simulated clock, from a "
                                             "calibrated profile; reports like bench serve")
    p.add_argument("--profile", required=True, metavar="PROFILE.json", help="written by tokenline bench calibrate")
    p.add_argument("--concurrency", type=int, default=1, help="most requests in flight")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache (and state) memory in GiB (default: the machine's memory less the weights, "
                        "or 2 on the calibrated machine)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks, overriding the memory arithmetic")
    p.add_argument("--model-config", default=None, metavar="CONFIG.json",
                   help="what if: another model (an HF config.json, e.g. tokenline/sim/configs/qwen3.5-27b.json); "
                        "step times scaled from the profile by a roofline ratio")
    p.add_argument("--machine", default=None, metavar="NAME|PATH",
                   help="what if: another machine: this (the calibrated one), h200, h100, a100-80gb, l4, or a JSON "
                        "file with memory_bandwidth_gbps, matmul_tflops, memory_gb, dtype")
    p.add_argument("--request-overhead-ms", type=float, default=None, help="override the profile's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--replicas", type=int, default=1,
                   help="what if: N simulated engines on one clock behind --routing-policy; the report adds "
                        "per-replica counts and the fleet prefix hit rate")
    add_routing_args(p)
    p.add_argument("--workload", default="random", choices=["random", "multiturn"],
                   help="bench serve's: random prompts, or multi-turn chats sharing system prompts")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="random: leading tokens every prompt shares")
    p.add_argument("--num-groups", type=int, default=4, help="multiturn: system prompts, one per group")
    p.add_argument("--num-conversations", type=int, default=16, help="multiturn: conversations over the groups")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--system-prompt-len", type=int, default=512, help="multiturn: tokens of each system prompt")
    p.add_argument("--tokenizer-dir", default=None,
                   help="multiturn: tokenizer and chat template (default: the default model's)")
    p.set_defaults(func=cmd_simulate)

    p = commands.add_parser("usage", help="usage and cost per tenant and model, from the usage ledger")
    p.add_argument("--db", default=None, help="ledger database (default: $TOKENLINE_HOME/usage.sqlite3)")
    p.add_argument("--since", default=None, help="from this time: unix seconds or ISO 8601 (UTC unless it says)")
    p.add_argument("--until", default=None, help="up to (not including) this time")
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_usage)

    p = commands.add_parser("top", help="live view of any server's vLLM metrics (/metrics): load, token rates, latency")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL or its /metrics URL")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="bearer key for /metrics (default: $VLLM_API_KEY)")
    p.add_argument("--interval", type=_positive_seconds, default=2.0,
                   help="seconds between scrapes; rates and quantiles cover this window")
    p.add_argument("--once", action="store_true", help="scrape twice, --interval apart, print one table and exit")
    p.add_argument("--json", action="store_true", help="print that one snapshot as JSON (implies --once)")
    p.set_defaults(func=cmd_top)

    keys = commands.add_parser("keys", help="manage API keys").add_subparsers(dest="keys", required=True)
    p = keys.add_parser("add", help="create a key for a new tenant and print it once")
    p.add_argument("name", help="tenant name")
    p.add_argument("--file", required=True, help="keys file (TOML); created if missing")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    p.add_argument("--tpm", type=int, default=None, help="tokens per minute, prompt + max_tokens (default: unlimited)")
    p.add_argument("--max-concurrent", type=int, default=None, help="requests in flight at once (default: unlimited)")
    p.add_argument("--daily-tokens", type=int, default=None, help="tokens per UTC day (default: unlimited)")
    p.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    p.add_argument("--admin", action="store_true", help="may call admin endpoints (usage, reload)")
    p.set_defaults(func=cmd_keys_add)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    parser = parser.command_parser(args)
    if unknown:  # reported by the subcommand that was given them
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "kv_events_config", None):
        try:  # a bad flag is a usage error, not a traceback
            parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            parser.error(str(exc))
    if hasattr(args, "engine_restart_max"):
        try:
            restart_policy_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

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
from tokenline.engine.config import QUANTIZATIONS, EngineConfig, parse_kv_events_config
from tokenline.setting_field import OFFLINE, ROUTER, SERVE, SIMULATE
from tokenline.settings.arg_types import positive_seconds
from tokenline.settings.catalog import add_settings, settings_kwargs
from tokenline.settings.config_file import apply_config_file
from tokenline.settings.options import RayOptions
from tokenline.settings.vllm_flags import (
    check_model_argument,
    check_tokenizer_argument,
    check_vllm_args,
    no_effect_warning,
    quiet_request_logs,
    speculative_config_overrides,
)

if TYPE_CHECKING:
    from tokenline.router.ray_serve import RayServeSettings
    from tokenline.settings.server import ServerSettings
    from tokenline.sim.replicas import FleetConfig


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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from the flags its command takes (the rest keep EngineConfig's defaults)."""
    config = EngineConfig(**settings_kwargs(EngineConfig, args))
    if getattr(args, "kv_events_config", None):
        config = dataclasses.replace(config, **parse_kv_events_config(args.kv_events_config))
    return config


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
    """``router``'s flags as serve's settings: what the router lacks (engine flags) keeps the
    settings' defaults, so one mapping (``serve_settings_from_args``) serves both."""
    from tokenline.router.data_parallel import build_policy
    from tokenline.router.remote_fleet import default_router_policy, parse_upstreams

    if (args.data_parallel_size or 1) > 1:
        raise ValueError("--data-parallel-size is serve's; a router's replicas are its --upstream servers")
    if args.unhealthy_after < 1:
        raise ValueError(f"--unhealthy-after must be at least 1, got {args.unhealthy_after}")
    specs = parse_upstreams(args.upstream)
    build_policy(args.routing_policy or default_router_policy(specs))  # an unknown name fails here
    return serve_settings_from_args(args)


def serve_settings_from_args(args: argparse.Namespace) -> tuple[ServerSettings, list[str]]:
    """The server's settings from ``serve``'s (or ``router``'s) flags, and the accepted flags that
    have no effect here. Raises ``ValueError`` (one-line message) for a value tokenline cannot honour."""
    from tokenline.api.app import ServerSettings, door_policy
    from tokenline.model.config import load_generation_config

    idle = check_vllm_args(args)
    check_model_argument(args.model)
    check_tokenizer_argument(args.tokenizer)
    if args.generation_config not in ("auto", "vllm"):
        load_generation_config(args.generation_config, Path())  # a folder without the file fails now
    for flag in ("max_connections", "max_pending_connections", "max_pending_per_address", "header_timeout",
                 "body_timeout", "body_min_rate"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be 0 (none) or more, got {getattr(args, flag)}")
    settings = ServerSettings(**{
        **settings_kwargs(ServerSettings, args),
        "model": args.model,  # the positional or vLLM's --model (check_vllm_args)
        "engine": dataclasses.replace(engine_config_from_args(args), **speculative_config_overrides(args)),
        "engine_restart": restart_policy_from_args(args),
    })
    if settings.engine.num_kv_blocks is not None and settings.engine.num_kv_blocks < 1:
        raise ValueError(f"--num-kv-blocks must be at least 1, got {settings.engine.num_kv_blocks}")
    settings.engine.validate()  # a bad engine flag is one line here, not a dead engine process later
    simulate = getattr(args, "simulate", None)  # serve's alone, as --ray's flags
    if settings.engine.speculative == "mtp" and not simulate:
        from tokenline.store.model_store import resolve_model
        from tokenline.model.mtp_checkpoint import check_mtp_checkpoint

        check_mtp_checkpoint(resolve_model(args.model, progress=False))  # a model without an MTP head: one line
    if simulate:
        from tokenline.sim.profile import Profile
        from tokenline.sim.replica import SimulatedReplica

        settings.engine.core_factory = SimulatedReplica(Profile.read(simulate), args.simulate_speed)
    elif getattr(args, "simulate_speed", 1.0) != 1.0:
        raise ValueError("--simulate-speed needs --simulate PROFILE.json")
    if settings.threads_per_engine is not None and settings.threads_per_engine < 1:
        raise ValueError(f"--threads-per-engine must be at least 1, got {settings.threads_per_engine}")
    if settings.data_parallel_size > 1:
        from tokenline.router.data_parallel import DEFAULT_DATA_PARALLEL_POLICY, build_policy

        build_policy(settings.routing_policy or DEFAULT_DATA_PARALLEL_POLICY)  # an unknown name fails here
    ray = RayOptions(**settings_kwargs(RayOptions, args))
    if getattr(args, "ray", False):
        settings.ray = ray_settings_from_args(args)
    elif ray.num_replicas != 1 or ray.address or ray.max_replicas is not None or ray.min_replicas is not None:
        raise ValueError("--num-replicas, --ray-address, --min-replicas and --max-replicas need --ray")
    door_policy(settings)  # contradictory access flags (e.g. --metrics-auth admin without keys) fail here
    return settings, idle


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
    return RayServeSettings(**settings_kwargs(RayOptions, args), routing_policy=policy,
                            session_affinity=args.session_affinity, threads_per_engine=args.threads_per_engine)


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy | None:
    policy = RestartPolicy(**settings_kwargs(RestartPolicy, args))
    return policy if policy.max_restarts else None  # 0: a dead engine stays dead (the server answers 503)


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from tokenline.model.config import ModelConfig
    from tokenline.store.model_store import resolve_model
    from tokenline.model.plan import plan_memory

    if args.accelerator is not None:
        return cmd_plan_fleet(args)
    if args.memory is None:
        print("tokenline plan: --memory GIB (a memory plan) or --accelerator NAME (a fleet plan) is required",
              file=sys.stderr)
        return 2
    source = Path(args.model) if args.model else None
    if source is not None and source.suffix == ".json":
        config = ModelConfig.from_dict(json.loads(source.read_text()))  # a bare config: no weights needed
    else:
        config = ModelConfig.from_dir(resolve_model(args.model))
    dtype_size = 4 if args.dtype == "float32" else 2
    print(plan_memory(config, args.memory, args.seq_len, dtype_size, args.hybrid_state_checkpoints,
                      args.block_size).format())
    return 0


def cmd_plan_fleet(args: argparse.Namespace) -> int:
    """``plan --accelerator``: a fleet from a traffic forecast (sim/fleet_plan.py)."""
    import json

    from tokenline.store.model_store import resolve_model
    from tokenline.sim.fleet_plan import DEFAULT_DAILY_CURVE, Forecast, PlanError, Slo, plan_fleet, users_to_rps
    from tokenline.sim.machine import MachineError, load_machine
    from tokenline.sim.plan_plot import write_plan_html
    from tokenline.sim.sim_target import read_model_config

    try:
        source = args.model if args.model and args.model.endswith(".json") else str(resolve_model(args.model))
        config = read_model_config(source)
        machine = load_machine(args.accelerator)
        slo = Slo(args.ttft_p99_ms, args.tpot_p50_ms, args.tpot_p99_ms)
        curve = tuple(float(x) for x in args.daily_curve.split(",")) if args.daily_curve else DEFAULT_DAILY_CURVE
        if (args.peak_rps is None) == (args.concurrent_users is None):
            raise PlanError("give the peak as one of --peak-rps or --concurrent-users")
        # Users wait for an answer (about its output at the TPOT objective) and think before the next.
        peak = args.peak_rps if args.peak_rps is not None else users_to_rps(
            args.concurrent_users, args.think_time, 0.5 + args.output_len * args.tpot_p50_ms / 1000)
        forecast = Forecast(peak, args.input_len, args.output_len, args.input_spread, args.output_spread,
                            args.shared_prefix_fraction, args.turns, args.think_time, curve)
        plan = plan_fleet(config, Path(source).stem if source.endswith(".json") else Path(source).name, machine,
                          forecast, slo, args.price_per_hour, (args.hosted_price_input, args.hosted_price_output),
                          args.headroom, tuple(int(x) for x in args.max_num_seqs_options.split(",")),
                          tensor_parallel_size=args.tensor_parallel_size, seed=args.seed)
    except (ValueError, OSError) as e:  # PlanError, MachineError and a bad config are ValueErrors
        print(f"tokenline plan: {e}", file=sys.stderr)
        return 2
    print(plan.format())
    if args.plot:
        write_plan_html(plan, args.plot)
        print(f"plot written to {args.plot}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    return 0


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from tokenline.frontend.qwen_vocab import build_qwen_tokenizer
    from tokenline.model.random_models import make_qwen3_5_0_8b, make_qwen3_5_tiny

    makers = {"qwen3.5-tiny": make_qwen3_5_tiny, "qwen3.5-0.8b": make_qwen3_5_0_8b}
    makers[args.kind](Path(args.out), seed=args.seed)
    build_qwen_tokenizer(Path(args.out))  # the real Qwen3.5 vocabulary, so the model can be served
    print(args.out)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from tokenline.store.model_store import resolve_model

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
    from tokenline.store.model_store import resolve_model

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
    from tokenline.store.model_store import resolve_model
    from tokenline.sim.calibrate import calibrate
    from tokenline.sim.calibration_load import CalibrationUnderLoad, LoadPolicy

    if args.request_overhead_ms is not None and args.request_overhead_ms < 0:
        print("tokenline bench calibrate: --request-overhead-ms must be >= 0", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model)
    except FileNotFoundError as e:
        print(f"tokenline bench calibrate: {e}", file=sys.stderr)
        return 2
    overhead = None if args.request_overhead_ms is None else args.request_overhead_ms / 1000
    try:
        policy = LoadPolicy(max_share=args.max_neighbour_cpu, retries=args.load_retries, allow_load=args.allow_load)
        profile = calibrate(model_dir, args.dtype, request_overhead_s=overhead, server_run=args.server_run,
                            threads=args.threads, load_policy=policy)
    except ValueError as e:
        print(f"tokenline bench calibrate: {e}", file=sys.stderr)
        return 2
    except CalibrationUnderLoad as e:
        print(f"tokenline bench calibrate: refused: {e}", file=sys.stderr)
        return 3
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
              f"+ {profile.step_overhead_per_seq_s * 1e3:.2f} ms/decode seq "
              f"(over {profile.server_steps} steps), {profile.request_overhead_s * 1e3:.1f} ms per request")
    load = profile.load or {}
    print(("UNDER LOAD, kept (--allow-load): " if load.get("under_load") else "load: ")
          + "; ".join([f"neighbours took {load.get('before_share', 0):.0%} of the CPU before, "
                       f"{load.get('mean_share', 0):.0%} on average, {load.get('worst_share', 0):.0%} at worst "
                       f"(threshold {load.get('max_share', 0):.0%}); {load.get('repeated', 0)} of "
                       f"{load.get('stretches', 0)} stretches run again", *load.get("notes", [])]))
    profile.write(args.output)
    print(f"profile written to {args.output}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from tokenline.engine.engine_core import RequestRejected
    from tokenline.sim.profile import Profile, ProfileError
    from tokenline.sim.profile_check import profile_warning, this_setup
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
        if config.what_if.model_config is None and config.what_if.machine in (None, "this"):
            setup = this_setup(args.dtype, args.threads, args.max_num_batched_tokens)
            if (warning := profile_warning(profile, setup, args.profile)) is not None:
                print(f"tokenline simulate: {warning}", file=sys.stderr)
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


def cmd_bench_prefill(args: argparse.Namespace) -> int:
    from tokenline.bench.prefill import PrefillConfig, run_prefill, write_json

    config = PrefillConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization, prompt_len=args.prompt_len,
        cached_prefix=args.cached_prefix, chunk=args.chunk, repeats=args.repeats, matmul_size=args.matmul_size,
        seed=args.seed, clock=args.clock,
    )
    try:
        config.validate()
    except ValueError as e:
        print(f"tokenline bench prefill: {e}", file=sys.stderr)
        return 2
    report = run_prefill(config, log=lambda line: print(line, file=sys.stderr))
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


def add_fleet_plan_args(p: argparse.ArgumentParser) -> None:
    """``plan --accelerator``'s forecast, SLO and price flags (docs/operate/planner.md)."""
    from tokenline.sim.fleet_plan import WORKERS_AI_PRICE

    g = p.add_argument_group("fleet plan")
    g.add_argument("--accelerator", default=None, metavar="NAME|PATH",
                   help="plan a fleet on this GPU of the table (h100, h200, a100-40gb, a100-80gb, l40s, rtx4090, l4) "
                        "or a machine JSON file with its achieved fractions")
    g.add_argument("--price-per-hour", type=float, default=None,
                   help="US$ per GPU-hour (default: the table's assumption)")
    g.add_argument("--peak-rps", type=float, default=None, help="forecast: requests per second at the peak hour")
    g.add_argument("--concurrent-users", type=float, default=None,
                   help="forecast: users at the peak, each sending a request, reading it and thinking --think-time")
    g.add_argument("--think-time", type=float, default=10.0, help="seconds between a user's (or a chat's) requests")
    g.add_argument("--daily-curve", default=None, metavar="24 LOADS",
                   help="comma-separated load of each hour 0-23, the peak hour 1 (default: a working day's shape)")
    g.add_argument("--input-len", type=int, default=1024, help="forecast: mean prompt tokens")
    g.add_argument("--output-len", type=int, default=256, help="forecast: mean output tokens")
    g.add_argument("--input-spread", type=float, default=0.5,
                   help="coefficient of variation of prompt lengths (log-normal)")
    g.add_argument("--output-spread", type=float, default=0.5, help="coefficient of variation of output lengths")
    g.add_argument("--shared-prefix-fraction", type=float, default=0.0,
                   help="share of a first prompt that is a system prompt every request shares")
    g.add_argument("--turns", type=int, default=1, help="requests per conversation (later turns carry the history)")
    g.add_argument("--ttft-p99-ms", type=float, default=2000.0, help="SLO: time to first token, 99th percentile")
    g.add_argument("--tpot-p50-ms", type=float, default=50.0, help="SLO: time per output token, median")
    g.add_argument("--tpot-p99-ms", type=float, default=100.0, help="SLO: time per output token, 99th percentile")
    g.add_argument("--headroom", type=float, default=0.2, help="spare capacity to keep at the peak (0.2: 20 %%)")
    g.add_argument("--max-num-seqs-options", default="256", metavar="N[,N...]",
                   help="max-num-seqs values to try per replica (default: vLLM's 256)")
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="fix the GPUs per replica (default: the fewest whose memory holds the model, and twice "
                        "that; the cheaper within the SLOs)")
    g.add_argument("--hosted-price-input", type=float, default=WORKERS_AI_PRICE[0],
                   help="hosted price to compare, US$ per M input tokens (default: Workers AI's Qwen3.8-27B)")
    g.add_argument("--hosted-price-output", type=float, default=WORKERS_AI_PRICE[1],
                   help="hosted price to compare, US$ per M output tokens")
    g.add_argument("--plot", default=None, metavar="PLAN.html",
                   help="write the latency-load and cost-load charts (self-contained HTML with SVG)")
    g.add_argument("--output-json", default=None, help="write the plan as JSON")
    g.add_argument("--seed", type=int, default=0, help="the simulated workload's seed")


def build_parser() -> CommandLineParser:
    parser = CommandLineParser(prog="tokenline", description="LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True, help="the command")

    p = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    add_settings(p, SERVE)
    p.set_defaults(func=cmd_serve)

    p = commands.add_parser("router", help="the gateway in front of remote tokenline or vLLM servers (--upstream)")
    add_settings(p, ROUTER)
    p.set_defaults(func=cmd_router)

    p = commands.add_parser("plan", help="memory plan (--memory): weights, KV per token, state per sequence, "
                                         "sequences that fit; fleet plan (--accelerator): replicas, settings, "
                                         "latency and cost per million tokens for a traffic forecast")
    p.add_argument("--model", default=None, help="model directory, .gguf file or a config.json (default: SmolLM2)")
    p.add_argument("--memory", type=float, default=None, help="memory plan: GiB of memory for weights + KV + states")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (prompt + output)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the weights and KV cache counted")
    p.add_argument("--hybrid-state-checkpoints", type=int, default=0, metavar="N",
                   help="hybrid models: state checkpoint slots to count (prefix caching)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV cache block (a sliding-window layer holds its window's blocks)")
    add_fleet_plan_args(p)
    p.set_defaults(func=cmd_plan)

    p = commands.add_parser("make-test-model",
                            help="write a random-weight model in HF format (tests, demos, benchmarks)")
    p.add_argument("kind", choices=["qwen3.5-tiny", "qwen3.5-0.8b"],
                   help="which model to make: qwen3.5-tiny (4 layers, tests) or qwen3.5-0.8b (Qwen3.5-0.8B's text "
                        "model, bfloat16, 1.5 GB: serving benchmarks)")
    p.add_argument("out", help="directory to write it to")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(func=cmd_make_test_model)

    p = commands.add_parser("import", help="import a model (default: SmolLM2-135M-Instruct) and print its directory")
    p.add_argument("model", nargs="?", default=None,
                   help="HF-format directory, .gguf file, or a packaged model's name (gemma3-270m)")
    p.set_defaults(func=cmd_import)

    p = commands.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="model directory or .gguf file (default: SmolLM2)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user message")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the model's generation config, else 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: random)")
    add_settings(p, OFFLINE)
    p.set_defaults(func=cmd_generate)

    p = commands.add_parser("trace", help="walk one chat request through the engine and show every stage")
    p.add_argument("question", help="the user message")
    p.add_argument("--model", default=None, help="model directory or .gguf file (default: SmolLM2)")
    p.add_argument("--system", default=None, help="a system message before the question")
    p.add_argument("--max-tokens", type=int, default=16, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-candidates", type=int, default=5, help="the sampler's top-K candidates shown per step")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="run the request N times (a repeat hits the prefix cache)")
    p.add_argument("--prices", default=None, help="TOML price table as for serve (default: zero cost)")
    p.add_argument("--json", action="store_true", help="print the trace as one JSON document")
    add_settings(p, OFFLINE)
    p.set_defaults(func=cmd_trace)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True,
                                                                                 help="the benchmark")
    p = bench.add_parser("throughput", help="offline throughput on synthetic prompts")
    p.add_argument("--model", default=None, help="model directory or .gguf file (default: SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--dtypes", nargs="+", default=None, choices=["auto", "float32", "bfloat16"],
                   help="run tokenline once per dtype (default: --dtype)")
    p.add_argument("--workload", default="random", choices=["random", "repeat"],
                   help="random token ids, or chats asking to repeat a passage (~input-len tokens) that the "
                        "answer copies, where --speculative ngram helps")
    p.add_argument("--compare-speculative", action="store_true",
                   help="run each dtype without and with speculation (--speculative, default ngram) side by side")
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate on the same prompts")
    p.add_argument("--hf-batch-size", type=int, default=32, help="with --hf: prompts per HF generate call")
    p.add_argument("--structured-json-schema", default=None, metavar="FILE",
                   help="run the workload without and then with this JSON schema on every request (one "
                        "engine), and report output tok/s of both and grammar compile p50/p99")
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the results as JSON")
    add_settings(p, OFFLINE)
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
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-groups", type=int, default=4, help="multiturn: system prompts, one per group")
    p.add_argument("--num-conversations", type=int, default=16, help="multiturn: conversations over the groups")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--system-prompt-len", type=int, default=512, help="multiturn: tokens of each system prompt")
    p.add_argument("--replica-metrics-url", action="append", default=None, metavar="URL",
                   help="read prefix-cache counters from this replica's /metrics (repeat per replica; "
                        "default: --base-url's)")
    p.add_argument("--metrics-api-key", default=None, help="key for /metrics (default: --api-key)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="Bearer key sent with every request")
    p.add_argument("--endpoint", default=None, choices=["completions", "chat"],
                   help="completions: token-id prompts, exact length; chat: decoded text, approximate "
                        "(default: completions; multiturn: chat)")
    p.add_argument("--tokenizer-dir", default=None, help="tokenizer for the random ids (default: the default model's)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="leading tokens every prompt shares")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help='fields merged into every request, e.g. \'{"structured_outputs": {"json": {...}}}\'')
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=cmd_bench_serve)

    p = bench.add_parser("roofline", help="decode step time against this machine's memory-bandwidth and FLOP limits")
    p.add_argument("--model", default=None, help="model directory or .gguf file (default: SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's dtype")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes timed")
    p.add_argument("--prompt-len", type=int, default=256, help="random prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed decode steps first")
    p.add_argument("--bandwidth-bytes", default="2GiB",
                   help="bandwidth buffer, far larger than the last-level cache (e.g. 2GiB, 64MiB)")
    p.add_argument("--repeats", type=int, default=5, help="runs per bandwidth method and matmul (median)")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n x n matmul peak")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=cmd_bench_roofline)

    p = bench.add_parser("prefill", help="chunked prefill of a long prompt after a cached prefix: the linears' "
                         "FLOP/s against the bf16 matmul peak, attention's time against theirs")
    p.add_argument("--model", default=None, help="model directory or .gguf file (default: SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's dtype")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                   help="hold the linears in these ggml blocks, as serve -q does")
    p.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens, the cached prefix included")
    p.add_argument("--cached-prefix", type=int, default=512,
                   help="the prompt's first tokens, left in the prefix cache by an earlier request")
    p.add_argument("--chunk", type=int, default=None, help="token budget of a step (default: the engine's)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills, fresh tokens each (median reported)")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n x n bf16 matmul peak")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this thread's CPU time, peak included (run with OMP_NUM_THREADS=1: robust to "
                        "neighbours on a shared machine)")
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=cmd_bench_prefill)

    p = bench.add_parser("calibrate", help="fit a step-time profile of the real engine on this machine (for simulate)")
    p.add_argument("--model", default=None, help="model directory or .gguf file (default: SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="the engine's dtype")
    p.add_argument("--output", default="profile.json", metavar="PROFILE.json", help="where the profile is written")
    p.add_argument("--request-overhead-ms", type=float, default=None,
                   help="per-request time outside the engine (HTTP, tokenize, detokenize) to store in the profile "
                        "(default: measured by the server run, else 0)")
    p.add_argument("--no-server-run", dest="server_run", action="store_false",
                   help="skip the short real-server run that fits the per-step and per-request server overheads")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads to calibrate with (default: torch's, as serve starts with)")
    p.add_argument("--max-neighbour-cpu", type=float, default=0.10, metavar="SHARE",
                   help="share of the machine's CPU (0-1) other processes may take during a stretch of runs before "
                        "it is run again or the calibration refused")
    p.add_argument("--load-retries", type=int, default=2,
                   help="times a stretch of runs taken under load is run again before it counts as loaded")
    p.add_argument("--allow-load", action="store_true",
                   help="keep a calibration taken under load (the profile records it, simulate warns) instead of "
                        "refusing it")
    p.set_defaults(func=cmd_bench_calibrate)

    p = commands.add_parser("simulate", help="the real scheduler and KV cache on a simulated clock, from a "
                                             "calibrated profile; reports like bench serve")
    p.add_argument("--profile", required=True, metavar="PROFILE.json", help="written by tokenline bench calibrate")
    p.add_argument("--concurrency", type=int, default=1, help="most requests in flight")
    p.add_argument("--num-prompts", type=int, default=64, help="random workload: requests")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache (and state) memory in GiB (default: the machine's memory less the weights, "
                        "or 2 on the calibrated machine)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks, overriding the memory arithmetic")
    p.add_argument("--model-config", default=None, metavar="CONFIG.json",
                   help="what if: another model (an HF config.json, e.g. tokenline/sim/configs/qwen3.5-27b.json); "
                        "step times scaled from the profile by a roofline ratio")
    p.add_argument("--machine", default=None, metavar="NAME|PATH",
                   help="what if: another machine: this (the calibrated one), a GPU of the table (h100, h200, "
                        "a100-40gb, a100-80gb, l40s, rtx4090, l4: priced by the accelerator step model, not from "
                        "the calibration), or a JSON file with memory_bandwidth_gbps, matmul_tflops, memory_gb, dtype")
    p.add_argument("--request-overhead-ms", type=float, default=None, help="override the profile's")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the simulated server's dtype (serve's --dtype), checked against the profile's")
    p.add_argument("--threads", type=int, default=None,
                   help="the simulated server's torch threads (default: torch's, as serve), checked against the "
                        "profile's")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--replicas", type=int, default=1,
                   help="what if: N simulated engines on one clock behind --routing-policy; the report adds "
                        "per-replica counts and the fleet prefix hit rate")
    add_settings(p, SIMULATE)  # --max-num-seqs, --max-num-batched-tokens and the routing flags, as serve's
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
    p.add_argument("--interval", type=positive_seconds, default=2.0,
                   help="seconds between scrapes; rates and quantiles cover this window")
    p.add_argument("--once", action="store_true", help="scrape twice, --interval apart, print one table and exit")
    p.add_argument("--json", action="store_true", help="print that one snapshot as JSON (implies --once)")
    p.set_defaults(func=cmd_top)

    keys = commands.add_parser("keys", help="manage API keys").add_subparsers(dest="keys", required=True, help="what to do")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (and its ``--config`` file) parsed and checked; a usage error exits 2."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "config", None):  # the file's values become defaults the command line overrides
        apply_config_file(parser.command_parser(args), args.config)
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

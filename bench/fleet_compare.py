#!/usr/bin/env python3
"""Routing policies compared on a fleet of two replicas of the default model, multiturn workload.

For a single replica (the reference) and then for each policy, this script starts fresh servers
(cold caches, 127.0.0.1, free ports), runs the same ``tokenline bench serve --workload multiturn``
(same seed: the same conversations), stops the servers by pid and prints one markdown table:
fleet-wide prefix-cache hit rate, per-replica rates, TTFT/TPOT p50, output tok/s, errors, and the
ratios the fleet targets are stated in (hit rate against the single replica and against
round_robin, TTFT p50 against round_robin).

    .venv/bin/python bench/fleet_compare.py [--mode dp|router|ray] [--policies round_robin,prefix,...]

--mode dp:     one ``tokenline serve --data-parallel-size 2 --threads-per-engine T --routing-policy P``;
               the hit rate from its /metrics (per replica: its per-upstream series).
--mode router: two ``tokenline serve`` (KV events published, OMP_NUM_THREADS=T) behind
               ``tokenline router --upstream URL,kv-events=… --routing-policy P``; the hit rate from
               each upstream's /metrics (the router's own copy lags by its scrape interval).
--mode ray:    one ``tokenline serve --ray --num-replicas 2 --threads-per-engine T --routing-policy P``
               (a local Ray cluster); the hit rate from its /metrics (the replicas' summed counters).
The single replica runs with T threads too, so that it is one member of the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenline.bench.ports import free_port
from tokenline.bench.results import BenchServeReport
from tokenline.bench.serve import BenchServeConfig, ServerNotReady, run_bench_serve
from tokenline.bench.serve import wait_healthy as bench_wait_healthy

POLICIES = ("round_robin", "least_load", "prefix", "kv_events")
REFERENCE = "single replica"
HEALTH_TIMEOUT_S = 300.0  # two engines loading on two busy cores
STOP_TIMEOUT_S = 30.0


@dataclass
class Launched:
    name: str
    url: str
    process: subprocess.Popen
    log: Path


@dataclass
class Running:
    """What a run talks to: the entry point, the /metrics URLs to read (empty: the entry point's)
    and every server started for it."""

    url: str
    metrics_urls: list[str]
    servers: list[Launched]


@contextmanager
def launch(name: str, args: list[str], logs: Path, threads: int | None = None) -> Iterator[Launched]:
    """``tokenline ARGS --host 127.0.0.1 --port <free>`` in its own session; stopped by pid on exit
    (SIGTERM so it stops its engines, then SIGKILL to whatever of its process group is left)."""
    port = free_port()
    log = logs / f"{name}-{port}.log"
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads in the engine process
    command = [sys.executable, "-m", "tokenline.cli", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield Launched(name, f"http://127.0.0.1:{port}", process, log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        _end_group(process.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _end_group(pgid: int, grace_s: float = 5.0) -> None:
    """What is left of a server's process group (its engines, a multiprocessing helper): a few
    seconds to exit on their own, then SIGKILL; returns once the group is gone (or reaping lags)."""
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


def wait_healthy(servers: list[Launched], timeout: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    for server in servers:
        try:
            bench_wait_healthy(server.url, server.process, timeout=max(0.0, deadline - time.monotonic()))
        except ServerNotReady as exc:
            raise RuntimeError(f"{server.name}: {exc}; log {server.log}:\n"
                               f"{server.log.read_text(errors='replace')[-3000:]}") from exc


def serve_args(args: argparse.Namespace, logs: Path, name: str) -> list[str]:
    cache = ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    return ["serve", "--kv-cache-memory", str(args.kv_cache_memory), *cache, "--dtype", args.dtype,
            "--usage-db", str(logs / f"{name}-usage.sqlite3"), "--disable-uvicorn-access-log"]


@contextmanager
def start_single(args: argparse.Namespace, logs: Path) -> Iterator[Running]:
    """One replica."""
    with launch("single", serve_args(args, logs, "single"), logs, threads=args.threads_per_engine) as server:
        wait_healthy([server])
        yield Running(server.url, [], [server])


@contextmanager
def start_fleet(args: argparse.Namespace, policy: str, logs: Path) -> Iterator[Running]:
    """Two replicas behind one entry point routing by ``policy``."""
    affinity = ["--session-affinity"] if args.session_affinity else []
    if args.mode in ("dp", "ray"):
        fleet = (["--data-parallel-size", "2"] if args.mode == "dp" else ["--ray", "--num-replicas", "2"])
        argv = [*serve_args(args, logs, f"{args.mode}-{policy}"), *fleet,
                "--threads-per-engine", str(args.threads_per_engine), "--routing-policy", policy, *affinity]
        with launch(f"{args.mode}-{policy}", argv, logs) as server:
            wait_healthy([server])
            yield Running(server.url, [], [server])
        return
    with ExitStack() as stack:
        upstreams, specs = [], []
        for i in range(2):
            events, replay = free_port(), free_port()
            config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://127.0.0.1:{events}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
            name = f"upstream{i}-{policy}"
            up = stack.enter_context(launch(name, [*serve_args(args, logs, name), "--kv-events-config", config],
                                            logs, threads=args.threads_per_engine))
            upstreams.append(up)
            specs.append(f"{up.url},kv-events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}")
        wait_healthy(upstreams)
        argv = ["router", *(a for spec in specs for a in ("--upstream", spec)), "--routing-policy", policy,
                "--usage-db", str(logs / f"router-{policy}-usage.sqlite3"), "--disable-uvicorn-access-log", *affinity]
        router = stack.enter_context(launch(f"router-{policy}", argv, logs))
        wait_healthy([router])
        yield Running(router.url, [u.url for u in upstreams], [*upstreams, router])


def run_workload(args: argparse.Namespace, url: str, metrics_urls: list[str]) -> BenchServeReport:
    config = BenchServeConfig(
        base_url=url, workload="multiturn", endpoint="chat", concurrency=args.max_concurrency,
        num_groups=args.num_groups, num_conversations=args.num_conversations, turns=args.turns,
        system_prompt_len=args.system_prompt_len, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed, replica_metrics_urls=metrics_urls, timeout=args.timeout,
    )
    return asyncio.run(run_bench_serve(config))


def routing_decisions(url: str) -> dict[str, int]:
    """The fleet's routing decisions by reason (``tokenline:router_decisions_total``), summed over
    replicas; {} where the entry point exports none (a single replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    reasons: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenline:router_decisions_total" and "reason" in sample.labels:
                reason = sample.labels["reason"]
                reasons[reason] = reasons.get(reason, 0) + int(sample.value)
    return reasons


# --- the table ---------------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize(reports: dict[str, BenchServeReport],
              decisions: dict[str, dict[str, int]] | None = None) -> list[dict[str, Any]]:
    """One row per run: the figures, the routing decisions by reason, and the ratios against the
    single replica and round_robin."""
    single = reports.get(REFERENCE)
    rr = reports.get("round_robin")
    rows = []
    for name, r in reports.items():
        rows.append({
            "policy": name,
            "hit_rate": r.prefix_cache_hit_rate,
            "replica_hit_rates": [x["hit_rate"] for x in r.prefix_cache_replicas] if len(r.prefix_cache_replicas) > 1
            else [],
            "replica_query_share": [x["queries"] / r.prefix_cache_queries for x in r.prefix_cache_replicas]
            if len(r.prefix_cache_replicas) > 1 and r.prefix_cache_queries else [],
            "cached_share": r.cached_tokens_share,
            "ttft_p50_ms": r.ttft_ms["p50"],
            "tpot_p50_ms": r.tpot_ms["p50"],
            "output_throughput": r.output_throughput,
            "errors": r.failed,
            "decisions": (decisions or {}).get(name, {}),
            "hit_rate_vs_single": _ratio(r.prefix_cache_hit_rate, single.prefix_cache_hit_rate) if single else None,
            "hit_rate_vs_round_robin": _ratio(r.prefix_cache_hit_rate, rr.prefix_cache_hit_rate) if rr else None,
            "ttft_p50_vs_round_robin": _ratio(r.ttft_ms["p50"], rr.ttft_ms["p50"]) if rr else None,
        })
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def pct(v: float | None) -> str:
        return "–" if v is None else f"{100 * v:.1f}%"

    def num(v: float | None, fmt: str = ".0f") -> str:
        return "–" if v is None else format(v, fmt)

    def times(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}×"

    lines = [
        ("| policy | fleet hit rate | per replica (share of tokens) | TTFT p50 ms | TPOT p50 ms | output tok/s | errors "
         "| hit rate vs single | hit rate vs round_robin | TTFT p50 vs round_robin | routing decisions |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        split = " / ".join(f"{pct(h)} ({pct(s)})" for h, s in zip(row["replica_hit_rates"], row["replica_query_share"]))
        lines.append(
            f"| {row['policy']} | {pct(row['hit_rate'])} | {split or '–'} | {num(row['ttft_p50_ms'])} "
            f"| {num(row['tpot_p50_ms'], '.1f')} | {num(row['output_throughput'], '.1f')} | {row['errors']} "
            f"| {times(row['hit_rate_vs_single'])} | {times(row['hit_rate_vs_round_robin'])} "
            f"| {times(row['ttft_p50_vs_round_robin'])} "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(row['decisions'].items())) or '–'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["dp", "router", "ray"], default="dp")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in this order")
    p.add_argument("--no-single", action="store_true", help="skip the single-replica reference")
    p.add_argument("--session-affinity", action="store_true", help="fleets keep a conversation (user) on a replica")
    p.add_argument("--threads-per-engine", type=int, default=1)
    p.add_argument("--kv-cache-memory", type=float, default=0.5, metavar="GIB", help="per replica")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per replica, overriding --kv-cache-memory (the same cache as simulate's "
                        "--num-kv-blocks, whatever the dtype)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    # The workload: small by default, so that five runs fit in a few minutes on two cores.
    # A conversation's own history (user messages and answers) outweighs its system prompt, as in
    # real chats: that is the part a replica without the conversation must prefill again.
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompt-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64, help="tokens per user message")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=4, help="conversations at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--logs", default=None, help="server logs (default: a temporary directory, kept on failure)")
    p.add_argument("--output-json", default=None, help="every run's bench serve report and the table's rows")
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICIES)}")
    if args.threads_per_engine < 1 or args.max_concurrency < 1 or (args.num_kv_blocks is not None and args.num_kv_blocks < 1):
        p.error("--threads-per-engine, --max-concurrency and --num-kv-blocks must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="fleet-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, Any]] = [] if args.no_single else [(REFERENCE, lambda: start_single(args, logs))]
    runs += [(policy, lambda policy=policy: start_fleet(args, policy, logs)) for policy in args.policies]
    reports: dict[str, BenchServeReport] = {}
    decisions: dict[str, dict[str, int]] = {}
    for name, start in runs:
        began = time.monotonic()
        print(f"[fleet_compare] {name}: starting ({args.mode if name != REFERENCE else 'one replica'})",
              file=sys.stderr, flush=True)
        with start() as running:
            reports[name] = run_workload(args, running.url, running.metrics_urls)
            decisions[name] = routing_decisions(running.url)
        r = reports[name]
        print(f"[fleet_compare] {name}: {r.completed} ok, {r.failed} failed, hit rate "
              f"{r.prefix_cache_hit_rate}, {time.monotonic() - began:.0f} s with start and stop"
              + (f" ({r.prefix_cache_note})" if r.prefix_cache_note else ""), file=sys.stderr, flush=True)
    rows = summarize(reports, decisions)
    print(f"mode {args.mode}, 2 replicas x {args.threads_per_engine} thread(s), {args.num_conversations} conversations "
          f"x {args.turns} turns over {args.num_groups} groups (system prompt {args.system_prompt_len}, user message "
          f"{args.input_len}, answer {args.output_len} tokens), {args.max_concurrency} at a time, seed {args.seed}"
          + (", session affinity" if args.session_affinity else ""))
    print()
    print(markdown_table(rows))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"settings": {k: v for k, v in vars(args).items()}, "rows": rows,
             "reports": {name: r.to_dict() for name, r in reports.items()}}, indent=2))
    print(f"\nserver logs: {logs}", file=sys.stderr)
    return 0 if all(r.failed == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

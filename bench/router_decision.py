"""What one routing decision costs: ``choose`` + ``on_routed`` per request for each policy in
``tokenline.router.policies``, at fleet scale (default: 64 replicas, 100k cached blocks spread over
them, ~2k-token prompts at block size 16), on this machine's one CPU core.

State before measuring: the approximate prefix policy has routed warm-up prompts until its trees
hold ``--cached-blocks`` blocks in all; the precise policy has applied ``BlockStored`` events (vLLM-
style int hashes) for the same number of blocks. Each measured prompt is one of the warm system
prompts (half the tokens) followed by fresh tokens, with random loads on the replicas. Also
reported: the cost of applying KV events, per stored block. Wall time on a shared machine includes
other processes' turns; the CPU columns are this thread's own time.

    .venv/bin/python bench/router_decision.py
    .venv/bin/python bench/router_decision.py --replicas 8 --cached-blocks 2000 --requests 200 --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenline.engine.kv_events import BlockStored  # noqa: E402
from tokenline.router.policies import POLICY_NAMES, ApproximatePrefix, PreciseKV, make_policy  # noqa: E402
from tokenline.router.policy import ReplicaState, RouteRequest, RoutingPolicy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--cached-blocks", type=int, default=100_000, help="blocks held over all replicas")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000, help="measured decisions per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.replicas, args.prompt_tokens, args.block_size, args.requests) < 1 or args.cached_blocks < 0:
        parser.error("sizes must be positive")
    return args


class Workload:
    """Warm prompts (a system prompt of half the tokens + a fresh half) and measured ones that
    reuse the warm system prompts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.half = args.prompt_tokens // 2
        self.blocks_per_prompt = max(1, args.prompt_tokens // args.block_size)
        # Enough warm prompts to fill the cache: each adds its fresh half; system prompts are
        # shared by a few prompts each.
        fresh_blocks = max(1, (args.prompt_tokens - self.half) // args.block_size)
        self.num_warm = max(1, args.cached_blocks // (fresh_blocks + 1))
        self.num_systems = max(1, self.num_warm // 4)
        self.systems = [self.tokens(self.half) for _ in range(self.num_systems)]
        self.names = [f"replica-{i:03d}" for i in range(args.replicas)]

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(49152) for _ in range(count)]

    def prompt(self, system: int) -> list[int]:
        return self.systems[system] + self.tokens(self.args.prompt_tokens - self.half)

    def states(self) -> list[ReplicaState]:
        rng = self.rng
        return [ReplicaState(name, num_running=rng.randrange(32), num_waiting=rng.randrange(4),
                             kv_cache_usage=rng.random(), in_flight=rng.randrange(4), block_size=self.args.block_size)
                for name in self.names]


def warm_approximate(policy: ApproximatePrefix, work: Workload) -> int:
    """Route warm prompts until the trees hold the target number of blocks."""
    states = work.states()
    i = 0
    while sum(policy.tree_size(n) for n in work.names) < work.args.cached_blocks and i < 10 * work.num_warm + 10:
        request = RouteRequest(f"warm-{i}", token_ids=work.prompt(i % work.num_systems))
        policy.on_routed(request, policy.choose(request, states))
        i += 1
    return sum(policy.tree_size(n) for n in work.names)


def warm_precise(policy: PreciseKV, work: Workload) -> tuple[int, float]:
    """Store warm prompts on replicas through events; returns (blocks held, µs per stored block)."""
    size, next_hash = work.args.block_size, 1
    spent_ns = stored_blocks = i = 0
    while sum(policy.cached_blocks(n) for n in work.names) < work.args.cached_blocks and i < 10 * work.num_warm + 10:
        tokens = work.prompt(i % work.num_systems)
        full = len(tokens) // size
        hashes = list(range(next_hash, next_hash + full))
        next_hash += full
        event = BlockStored(hashes, None, tokens[: full * size], size, None, "GPU")
        replica = work.names[(i % work.num_systems) % len(work.names)]
        start = time.perf_counter_ns()
        policy.on_kv_events(replica, [event])
        spent_ns += time.perf_counter_ns() - start
        stored_blocks += full
        i += 1
    held = sum(policy.cached_blocks(n) for n in work.names)
    return held, spent_ns / 1000 / max(1, stored_blocks)


def measure(policy: RoutingPolicy, work: Workload) -> tuple[list[float], list[float]]:
    """µs of choose + on_routed for each measured request: wall time, and this thread's CPU time
    (what the decision itself costs, without the time a busy machine gave other processes)."""
    wall: list[float] = []
    cpu: list[float] = []
    states_pool = [work.states() for _ in range(16)]
    for i in range(work.args.requests):
        request = RouteRequest(f"q-{i}", token_ids=work.prompt(work.rng.randrange(work.num_systems)))
        states = states_pool[i % len(states_pool)]
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        decision = policy.choose(request, states)
        policy.on_routed(request, decision)
        cpu.append((time.thread_time_ns() - start_cpu) / 1000)
        wall.append((time.perf_counter_ns() - start) / 1000)
        policy.on_finished(request.request_id, decision.replica)
    return wall, cpu


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in POLICY_NAMES:
        work = Workload(args)  # the same seed: every policy sees the same prompts
        policy = make_policy(name, seed=args.seed)
        extra: dict[str, Any] = {"cached_blocks": 0}
        if isinstance(policy, ApproximatePrefix):
            extra["cached_blocks"] = warm_approximate(policy, work)
        elif isinstance(policy, PreciseKV):
            extra["cached_blocks"], extra["event_us_per_block"] = warm_precise(policy, work)
        wall, cpu = measure(policy, work)
        rows[name] = {"median_us": statistics.median(wall), "p99_us": p99(wall), "mean_us": statistics.fmean(wall),
                      "cpu_median_us": statistics.median(cpu), "cpu_p99_us": p99(cpu), **extra}
    return {"replicas": args.replicas, "cached_blocks_target": args.cached_blocks, "prompt_tokens": args.prompt_tokens,
            "block_size": args.block_size, "requests": args.requests, "policies": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(f"{args.replicas} replicas, {args.prompt_tokens}-token prompts, block size {args.block_size}, "
          f"{args.requests} decisions per policy (choose + on_routed)")
    print(f"{'policy':<12} {'median µs':>10} {'p99 µs':>10} {'cpu median':>11} {'cpu p99':>9} "
          f"{'cached blocks':>14} {'event µs/block':>15}")
    for name, row in report["policies"].items():
        event = f"{row['event_us_per_block']:.2f}" if "event_us_per_block" in row else "-"
        print(f"{name:<12} {row['median_us']:>10.1f} {row['p99_us']:>10.1f} {row['cpu_median_us']:>11.1f} "
              f"{row['cpu_p99_us']:>9.1f} {row['cached_blocks']:>14} {event:>15}")
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

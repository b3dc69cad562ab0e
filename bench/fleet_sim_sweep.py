#!/usr/bin/env python3
"""Routing policies against round robin over seeds and workload shapes, in the simulator.

For every shape (KV blocks per replica / groups / system prompt tokens) and seed, ``tokenline
simulate --replicas 2 --workload multiturn`` runs once per policy (and once with one replica, the
"single" reference); the table gives, per shape and policy, the fleet prefix hit rate over the seeds
and the ratios the fleet targets are stated in — hit rate / round robin's (median and min over the
seeds), / the single replica's (min), TTFT p50 / round robin's (median and max) and output tok/s /
round robin's (min) — each ratio taken within one seed, so that a shape's verdict never rests on
one lucky draw.

    .venv/bin/python bench/fleet_sim_sweep.py --profile profile.json \\
        --shapes 300/16/1024,250/8/1024 --seeds 0-4 --policies round_robin,prefix,kv_events

Runs are independent, so ``--jobs`` processes share them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenline.router.policies import POLICY_NAMES
from tokenline.sim.profile import Profile
from tokenline.sim.replicas import FleetConfig, simulate_replicas
from tokenline.sim.simulate import SimConfig

SINGLE = "single"


@dataclass(frozen=True)
class Shape:
    num_kv_blocks: int
    num_groups: int
    system_prompt_len: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        try:
            blocks, groups, system = (int(x) for x in text.split("/"))
        except ValueError:
            raise ValueError(f"a shape is BLOCKS/GROUPS/SYSTEM_LEN, e.g. 300/16/1024, not {text!r}") from None
        return cls(blocks, groups, system)

    def __str__(self) -> str:
        return f"{self.num_kv_blocks}/{self.num_groups}/{self.system_prompt_len}"


@dataclass
class Run:
    shape: str
    policy: str
    seed: int
    hit_rate: float
    ttft_p50_ms: float
    output_tok_s: float


def run_one(profile_path: str, args: dict, shape: Shape, policy: str, seed: int) -> Run:
    """One simulation; ``policy`` "single" is one replica (its policy never asked)."""
    config = SimConfig(concurrency=args["concurrency"], num_prompts=args["num_conversations"],
                       input_len=args["input_len"], output_len=args["output_len"], seed=seed,
                       num_kv_blocks=shape.num_kv_blocks)
    fleet = FleetConfig(replicas=1 if policy == SINGLE else 2,
                        routing_policy="round_robin" if policy == SINGLE else policy, workload="multiturn",
                        num_groups=shape.num_groups, num_conversations=args["num_conversations"],
                        turns=args["turns"], system_prompt_len=shape.system_prompt_len)
    report = simulate_replicas(Profile.read(profile_path), config, fleet)
    return Run(str(shape), policy, seed, report.prefix_cache_hit_rate or 0.0, report.ttft_ms["p50"] or 0.0,
               report.output_throughput)


def summarize(runs: list[Run], shapes: list[Shape], policies: list[str]) -> list[dict]:
    """One row per shape and policy; ratios within a seed, then median / min / max over the seeds."""
    by = {(r.shape, r.policy, r.seed): r for r in runs}
    rows = []
    for shape in map(str, shapes):
        for policy in policies:
            mine = sorted((r for r in runs if r.shape == shape and r.policy == policy), key=lambda r: r.seed)
            if not mine:
                continue
            row: dict = {"shape": shape, "policy": policy, "hit_rates": [r.hit_rate for r in mine]}

            def ratios(other: str, field: str, mine: list[Run] = mine) -> list[float]:
                return [getattr(r, field) / getattr(o, field) for r in mine
                        if (o := by.get((shape, other, r.seed))) is not None and getattr(o, field)]

            if policy not in ("round_robin", SINGLE):
                hit, ttft, tok = (ratios("round_robin", f) for f in ("hit_rate", "ttft_p50_ms", "output_tok_s"))
                single = ratios(SINGLE, "hit_rate")
                row.update(
                    vs_rr_median=statistics.median(hit) if hit else None, vs_rr_min=min(hit, default=None),
                    vs_single_min=min(single, default=None),
                    ttft_vs_rr_median=statistics.median(ttft) if ttft else None,
                    ttft_vs_rr_max=max(ttft, default=None), tok_s_vs_rr_min=min(tok, default=None))
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    def x(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}×"

    lines = ["| blocks/groups/system | policy | hit rate by seed | vs RR median | vs RR min | vs single min "
             "| TTFT p50 vs RR median (max) | tok/s vs RR min |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        hits = " ".join(f"{100 * h:.1f}" for h in r["hit_rates"])
        lines.append(f"| {r['shape']} | {r['policy']} | {hits} | {x(r.get('vs_rr_median'))} | {x(r.get('vs_rr_min'))} "
                     f"| {x(r.get('vs_single_min'))} | {x(r.get('ttft_vs_rr_median'))} ({x(r.get('ttft_vs_rr_max'))}) "
                     f"| {x(r.get('tok_s_vs_rr_min'))} |")
    return "\n".join(lines)


def parse_seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="written by tokenline bench calibrate")
    p.add_argument("--shapes", default="300/16/1024", help="comma-separated BLOCKS/GROUPS/SYSTEM_LEN")
    p.add_argument("--seeds", default="0-4", help="FIRST-LAST")
    p.add_argument("--policies", default="round_robin,prefix,kv_events",
                   help=f"comma-separated of {', '.join(POLICY_NAMES)}; round_robin is always run")
    p.add_argument("--no-single", action="store_true", help="skip the one-replica reference")
    p.add_argument("--num-conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    try:
        args.shapes = [Shape.parse(s) for s in args.shapes.split(",")]
        args.seeds = parse_seeds(args.seeds)
    except ValueError as error:
        p.error(str(error))
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICY_NAMES]
    if unknown:
        p.error(f"--policies: unknown {', '.join(unknown)}; choose from {', '.join(POLICY_NAMES)}")
    args.policies = ["round_robin", *(x for x in policies if x != "round_robin")]
    if not args.no_single:
        args.policies.append(SINGLE)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = {k: getattr(args, k) for k in ("num_conversations", "turns", "input_len", "output_len", "concurrency")}
    jobs = [(shape, policy, seed) for shape in args.shapes for seed in args.seeds for policy in args.policies]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, args.profile, workload, *job) for job in jobs]
        runs = []
        for future in futures:
            runs.append(future.result())
            r = runs[-1]
            print(f"[fleet_sim_sweep] {r.shape} {r.policy} seed {r.seed}: hit {100 * r.hit_rate:.1f}%",
                  file=sys.stderr, flush=True)
    rows = summarize(runs, args.shapes, args.policies)
    print(f"2 replicas, {args.num_conversations} conversations x {args.turns} turns, user {args.input_len} / answer "
          f"{args.output_len} tokens, {args.concurrency} at a time, seeds {args.seeds[0]}-{args.seeds[-1]}")
    print()
    print(markdown(rows))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"runs": [asdict(r) for r in runs], "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Batch-1..8 decode step: the one-call fused layer (cpu_kernels.decode_layer_) against the
torch-operator path, side by side in one process, with a greedy-agreement check.

Two copies of the same B random prompts live in one KV pool; path A (torch operators) and path B
(fused layers) each decode their own copy, steps alternating A, B, A, B, so both see the same
machine. Reports per path the median wall and thread CPU time of ``ModelRunner.execute`` (the
whole step: model, LM head, sampling) and whether the greedy tokens agree. ``--profile`` prints
torch.profiler's per-operator table of path A at batch 1.

    .venv/bin/python bench/decode_dispatch.py --batch-sizes 1 2 4 8 --steps 40 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from tokenline.model.batch import ScheduledBatch, ScheduledSeq
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams
from tokenline.store.model_store import resolve_model

BLOCK_SIZE = 16


def _step(runner: ModelRunner, seqs: list[list[int]], tables: list[list[int]], sp: SamplingParams) -> list[int]:
    """One decode step for every sequence (its last token's KV and the next token); appends it."""
    batch = ScheduledBatch([
        ScheduledSeq(f"s{i}", [s[-1]], len(s) - 1, tables[i], True, sp) for i, s in enumerate(seqs)
    ])
    out = runner.execute(batch)
    tokens = [out[f"s{i}"].token_id for i in range(len(seqs))]
    for s, t in zip(seqs, tokens, strict=True):
        s.append(t)
    return tokens


def run(batch_size: int, steps: int, prompt_len: int, warmup: int, runner: ModelRunner, profile: bool) -> dict:
    model = runner.model
    fused_rows = model.fused_decode_rows
    sp = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 1).with_defaults()
    blocks_per_seq = -(-(prompt_len + steps + warmup + 2) // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(batch_size)
    prompts = [torch.randint(100, 40000, (prompt_len,), generator=gen).tolist() for _ in range(batch_size)]
    paths = {"torch": 0, "fused": fused_rows}
    state = {}
    for p, name in enumerate(paths):
        tables = [list(range((p * batch_size + i) * blocks_per_seq, (p * batch_size + i + 1) * blocks_per_seq))
                  for i in range(batch_size)]
        seqs = [list(x) for x in prompts]
        # Prefill (all but the last token) through the torch path; decoding starts at the last one.
        model.fused_decode_rows = 0
        runner.execute(ScheduledBatch([
            ScheduledSeq(f"s{i}", s[:-1], 0, tables[i], False, sp) for i, s in enumerate(seqs)
        ]))
        state[name] = (seqs, tables)
    wall: dict[str, list[float]] = {n: [] for n in paths}
    cpu: dict[str, list[float]] = {n: [] for n in paths}
    for i in range(warmup + steps):
        for name, rows in paths.items():
            model.fused_decode_rows = rows
            w0, c0 = time.perf_counter(), time.thread_time()
            _step(runner, *state[name], sp)
            if i >= warmup:
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.thread_time() - c0)
    agree = state["torch"][0] == state["fused"][0]
    if profile and batch_size == 1:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        model.fused_decode_rows = 0
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                _step(runner, *state["torch"], sp)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    model.fused_decode_rows = fused_rows
    row = {"batch": batch_size, "agree": agree}
    for name in paths:
        row[f"{name}_wall_ms"] = statistics.median(wall[name]) * 1e3
        row[f"{name}_cpu_ms"] = statistics.median(cpu[name]) * 1e3
    row["ratio_wall"] = row["fused_wall_ms"] / row["torch_wall_ms"]
    row["ratio_cpu"] = row["fused_cpu_ms"] / row["torch_cpu_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--fused-rows", type=int, default=4, help="rows the fused path takes in this bench")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    runner = ModelRunner(resolve_model(None), getattr(torch, args.dtype))
    longest = args.prompt_len + args.steps + args.warmup + 2
    runner.allocate_kv_cache(2 * max(args.batch_sizes) * -(-longest // BLOCK_SIZE), BLOCK_SIZE)
    runner.model.fused_decode_rows = args.fused_rows
    with open("/proc/loadavg") as f:
        print(f"threads {torch.get_num_threads()}, load average {f.read().split()[0]} at start")
    print("batch | torch ms wall (cpu) | fused ms wall (cpu) | fused/torch wall (cpu) | greedy tokens agree")
    for b in args.batch_sizes:
        r = run(b, args.steps, args.prompt_len, args.warmup, runner, args.profile)
        print(f"{b} | {r['torch_wall_ms']:.2f} ({r['torch_cpu_ms']:.2f}) | {r['fused_wall_ms']:.2f} "
              f"({r['fused_cpu_ms']:.2f}) | {r['ratio_wall']:.3f} ({r['ratio_cpu']:.3f}) | {r['agree']}", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average {f.read().split()[0]} at end")


if __name__ == "__main__":
    main()

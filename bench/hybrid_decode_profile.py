"""The hybrid's decode step at batch B: its wall time and where it goes (torch.profiler, per operator).

Loads a Qwen3.5-shaped HF directory (e.g. the peers harness's random-weight qwen3.5-0.8b) into a
``ModelRunner``, prefills B random prompts, then times decode steps (``ModelRunner.execute``: the
model, the LM head and sampling) and prints the median, the weights' and the recurrent states' bytes
a step must move, and torch.profiler's operator table over a few steps.

    .venv/bin/python bench/hybrid_decode_profile.py /tmp/tokenline-peers/models/qwen3.5-0.8b/hf --batch 8
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

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HF-format directory of a hybrid model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = ModelRunner(Path(args.model), torch.bfloat16, max_model_len=4096)
    longest = args.prompt_len + args.steps + args.profile_steps + 4
    per_seq = -(-longest // BLOCK_SIZE)
    runner.allocate_kv_cache(args.batch * per_seq, BLOCK_SIZE, num_state_slots=args.batch)
    sp = SamplingParams(temperature=0.0, max_tokens=longest).with_defaults()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.batch)]
    out = runner.execute(ScheduledBatch([ScheduledSeq(f"s{i}", s, 0, tables[i], True, sp, state_slot=i)
                                         for i, s in enumerate(seqs)]))
    for i, s in enumerate(seqs):
        s.append(out[f"s{i}"].token_id)

    def step() -> None:
        batch = ScheduledBatch([ScheduledSeq(f"s{i}", [s[-1]], len(s) - 1, tables[i], True, sp, state_slot=i)
                                for i, s in enumerate(seqs)])
        result = runner.execute(batch)
        for i, s in enumerate(seqs):
            s.append(result[f"s{i}"].token_id)

    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    states = sum(t.numel() * t.element_size() for cache in runner.kv_caches if isinstance(cache, tuple)
                 for t in cache)
    print(f"batch {args.batch}: decode step median {1e3 * statistics.median(walls):.1f} ms "
          f"({args.batch / statistics.median(walls):.1f} tok/s); weights {weights / 2**20:.0f} MiB, "
          f"recurrent + conv states {states / 2**20:.0f} MiB; threads {torch.get_num_threads()}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()

"""Decode step time of Gemma 3 270M (imported), the one-call layers against the per-operator path, interleaved
in one process: `python bench/gemma3_fused_step.py bfloat16|float32 none|q8_0|q4_1`."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from tokenline.model.batch import ScheduledBatch, ScheduledSeq
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams

dtype = getattr(torch, sys.argv[1]); quant = None if sys.argv[2] == "none" else sys.argv[2]
model_dir = Path.home() / ".cache/tokenline/models/gemma3-270m"
runner = ModelRunner(model_dir, dtype, quantization=quant)
model = runner.model
rows_fused = model.fused_decode_rows
print("fused_step_tokens", model.fused_step_tokens())
bs = 16
runner.allocate_kv_cache(512, bs)
groups = len(runner.kv_group_windows)
sp = SamplingParams(temperature=0.0, max_tokens=512).with_defaults()
for batch in (1, 8):
    ctx = 300
    per = -(-(ctx + 40) // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    def seq(i: int, toks: list[int], start: int) -> ScheduledSeq:
        s = ScheduledSeq(f"s{i}", toks, start, tables[i], True, sp)
        # One table for every KV cache group: their layers overwrite each other's K/V, which timing ignores.
        s.group_block_tables = [tables[i]] * groups
        return s
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 200000, (ctx,), generator=gen).tolist() for _ in range(batch)]
    model.fused_decode_rows = 0
    runner.execute(ScheduledBatch([seq(i, p, 0) for i, p in enumerate(prompts)]))
    times = {"torch": [], "fused": []}
    model_times = {"torch": [], "fused": []}
    for step in range(12):
        for path, r in (("torch", 0), ("fused", rows_fused)):
            model.fused_decode_rows = r
            b = ScheduledBatch([seq(i, [prompts[i][-1]], ctx + step) for i in range(batch)])
            t0 = time.perf_counter(); runner.execute(b); times[path].append(time.perf_counter() - t0)
    print(f"{sys.argv[1]} {quant} batch {batch}: step ms median torch {1e3*statistics.median(times['torch']):.1f} "
          f"fused {1e3*statistics.median(times['fused']):.1f}  (min {1e3*min(times['torch']):.1f} / {1e3*min(times['fused']):.1f})")

"""One Gemma 3 270M decode step at a batch of sequences (default 32), context ~300, offline (no server).

Usage: PYTHONPATH=. python bench/gemma3_step32.py bfloat16 none 32     (bf16 layer)
       PYTHONPATH=. python bench/gemma3_step32.py bfloat16 q4_1 32     (q4_1 weights, float32 layer)
A fifth argument prints torch's profiler table. Prints the median and min of 8 steps.
"""
import statistics, sys, time
from pathlib import Path
import torch
from tokenline.model.batch import ScheduledBatch, ScheduledSeq
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams
dtype = getattr(torch, sys.argv[1]); quant = None if sys.argv[2] == "none" else sys.argv[2]
batch = int(sys.argv[3])
runner = ModelRunner(Path.home() / ".cache/tokenline/models/gemma3-270m", dtype, quantization=quant)
model = runner.model
bs = 16
runner.allocate_kv_cache(2048, bs)
groups = len(runner.kv_group_windows)
sp = SamplingParams(temperature=0.0, max_tokens=512).with_defaults()
ctx = 300
per = -(-(ctx + 40) // bs)
tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
def seq(i, toks, start):
    s = ScheduledSeq(f"s{i}", toks, start, tables[i], True, sp)
    s.group_block_tables = [tables[i]] * groups
    return s
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 200000, (ctx,), generator=gen).tolist() for _ in range(batch)]
for i in range(0, batch, 8):
    runner.execute(ScheduledBatch([seq(j, prompts[j], 0) for j in range(i, min(batch, i+8))]))
ts = []
for step in range(8):
    b = ScheduledBatch([seq(i, [prompts[i][-1]], ctx + step) for i in range(batch)])
    t0 = time.perf_counter(); runner.execute(b); ts.append(time.perf_counter() - t0)
print(f"batch {batch} step ms median {1e3*statistics.median(ts):.1f} min {1e3*min(ts):.1f}")
if len(sys.argv) > 4:
    from torch.profiler import profile
    with profile() as prof:
        for step in range(8, 12):
            runner.execute(ScheduledBatch([seq(i, [prompts[i][-1]], ctx + step) for i in range(batch)]))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

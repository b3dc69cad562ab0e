"""Prefill time of Gemma 3 270M (imported): one step of 8 fresh 256-token prompts, in ms a token
and GFLOP/s over its ~88 M non-embedding parameters. This is where a c=32 run spends its first
seconds, since its 32 prompts arrive at once.

    .venv/bin/python bench/gemma3_prefill.py none|q8_0|q4_1
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from tokenline.model.batch import ScheduledBatch, ScheduledSeq
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams

NON_EMBEDDING_PARAMS = 88e6  # 18 layers x ~4.9 M (attention 1.0 M, GeGLU 3.9 M)
BATCH, PROMPT, BLOCK = 8, 256, 16


def main() -> None:
    quant = None if sys.argv[1] == "none" else sys.argv[1]
    runner = ModelRunner(Path.home() / ".cache/tokenline/models/gemma3-270m", torch.bfloat16, quantization=quant)
    runner.allocate_kv_cache(2048, BLOCK)
    groups = len(runner.kv_group_windows)
    params = SamplingParams(temperature=0.0, max_tokens=512).with_defaults()
    per = -(-(PROMPT + 40) // BLOCK)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(BATCH)]
    gen = torch.Generator().manual_seed(0)

    def seq(i: int, tokens: list[int]) -> ScheduledSeq:
        s = ScheduledSeq(f"s{i}", tokens, 0, tables[i], True, params)
        s.group_block_tables = [tables[i]] * groups  # every KV cache group on one table: timing only
        return s

    times = []
    for _ in range(4):
        prompts = [torch.randint(100, 200000, (PROMPT,), generator=gen).tolist() for _ in range(BATCH)]
        start = time.perf_counter()
        runner.execute(ScheduledBatch([seq(i, p) for i, p in enumerate(prompts)]))
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    tokens = BATCH * PROMPT
    print(f"{quant} prefill {BATCH}x{PROMPT}: median {1e3 * t:.0f} ms = {1e3 * t / tokens:.3f} ms/token; "
          f"{2 * NON_EMBEDDING_PARAMS * tokens / t / 1e9:.0f} GFLOP/s over the non-embedding parameters")


if __name__ == "__main__":
    main()

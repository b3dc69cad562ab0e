"""Several sequences' prefill spans through one attention layer: one SDPA per span (as before)
against one padded, batched call (tokenline/model/prefill_attention.py). The whole
``paged_attention`` of a step of spans only, cache write included (the same in both), on the tiny
test model's shape, the default model's (SmolLM2-135M) and one of Qwen3.5-27B's attention layers,
random K/V in a shuffled paged pool, CPU. Reports the median process CPU seconds per call (the
machine may be shared: wall time includes others' turns) and the speedup; the thresholds in
prefill_attention.py come from this grid.

    .venv/bin/python bench/attention_batched_prefill.py
    .venv/bin/python bench/attention_batched_prefill.py --shapes default --spans 8 16 --tokens 4 8 --prefix 0 256
    .venv/bin/python bench/attention_batched_prefill.py --ragged   # spans of different lengths
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from tokenline.model import prefill_attention
from tokenline.model.attention import AttentionMetadata, paged_attention
from tokenline.model.prefill_attention import PrefillSpan

SHAPES = {  # (query heads, KV heads, head dim)
    "tiny": (4, 2, 32),
    "default": (9, 3, 64),  # SmolLM2-135M
    "27b": (24, 4, 256),  # Qwen3.5-27B's full-attention layers
}
BLOCK_SIZE = 16


def make_step(
    heads: int, kv_heads: int, head_dim: int, spans: int, tokens: int, prefix: int, ragged: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step's q/k/v, a pool holding each span's cached prefix, and the spans' metadata.
    Ragged: span b has about (1 - b / 2B) of the tokens and prefix, so the longest is padded to."""
    gen = torch.Generator().manual_seed(0)
    shrink = [1 - b / (2 * spans) if ragged else 1.0 for b in range(spans)]
    lens = [max(1, round(tokens * f)) for f in shrink]
    prefixes = [round(prefix * f) for f in shrink]
    blocks = [-(-(p + n) // BLOCK_SIZE) for p, n in zip(prefixes, lens)]
    order = torch.randperm(sum(blocks), generator=gen)  # sequences' blocks scattered over the pool
    cache = torch.randn(2, sum(blocks), BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
    slots: list[int] = []
    start = used = 0
    for n, p, b in zip(lens, prefixes, blocks):
        table = order[used : used + b]
        used += b
        meta.prefills.append(PrefillSpan(start, n, p + n, table))
        slots.extend(int(table[pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(p, p + n))
        start += n
    meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
    return q, k, v, cache, meta


def cpu_ms(runs: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median process CPU milliseconds of each run, the runs taking turns so that a busy spell on
    the machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, run in runs.items():
        run()  # warm-up
    for _ in range(repeat):
        for name, run in runs.items():
            started = time.process_time()
            run()
            times[name].append(time.process_time() - started)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def measure(
    shape: str, spans: int, tokens: int, prefix: int, ragged: bool, repeat: int, dtype: torch.dtype
) -> dict[str, float | int | str | bool]:
    q, k, v, cache, meta = make_step(*SHAPES[shape], spans, tokens, prefix, ragged, dtype)
    result: dict[str, float | int | str | bool] = {
        "shape": shape, "spans": spans, "tokens_per_span": tokens, "cached_prefix": prefix, "ragged": ragged,
    }
    def run_with(min_spans: int, max_bytes: int) -> Callable[[], object]:
        def run() -> object:
            saved = prefill_attention.BATCHED_PREFILL_MIN_SPANS, prefill_attention.BATCHED_PREFILL_MAX_QUERY_BYTES
            prefill_attention.BATCHED_PREFILL_MIN_SPANS, prefill_attention.BATCHED_PREFILL_MAX_QUERY_BYTES = (
                min_spans, max_bytes)
            try:
                return paged_attention(q, k, v, cache, meta)
            finally:
                prefill_attention.BATCHED_PREFILL_MIN_SPANS, prefill_attention.BATCHED_PREFILL_MAX_QUERY_BYTES = saved
        return run

    with torch.inference_mode():
        medians = cpu_ms({"one_by_one": run_with(10**9, 0), "batched": run_with(2, 10**9)}, repeat)
    for name, ms in medians.items():
        result[f"{name}_cpu_ms"] = round(ms, 3)
    result["speedup"] = round(float(result["one_by_one_cpu_ms"]) / float(result["batched_cpu_ms"]), 2)
    result["threshold_batches"] = prefill_attention.batches_prefills(meta.prefills, q)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--spans", nargs="+", type=int, default=[2, 8, 32])
    parser.add_argument("--tokens", nargs="+", type=int, default=[4, 16, 64, 256])
    parser.add_argument("--prefix", nargs="+", type=int, default=[0, 256], help="cached tokens before each span")
    parser.add_argument("--ragged", action="store_true", help="spans of different lengths and prefixes")
    parser.add_argument("--max-step-tokens", type=int, default=4096, help="skip grid points above this many tokens")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a fair count on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for shape in args.shapes:
        for prefix in args.prefix:
            for spans in args.spans:
                for tokens in args.tokens:
                    if spans * tokens > args.max_step_tokens:
                        continue
                    print(json.dumps(measure(shape, spans, tokens, prefix, args.ragged, args.repeat, dtype)), flush=True)


if __name__ == "__main__":
    main()

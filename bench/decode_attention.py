"""Decode attention against the memory-bandwidth bound, old kernel and new side by side.

One query token per sequence over a paged KV cache (bf16, or `--dtype float32`) of the default model's shape (SmolLM2-135M:
9 query heads, 3 KV heads, head_dim 64, 16-token blocks scattered through the pool), for a grid of
batch x context. Each timed pass runs every layer of a stack (separate caches, as the model's
layers have) after streaming a buffer larger than the last-level cache, so the KV is read from
memory, as in a real decode step where the weights pass through the cache in between.

Paths, in the same run: ``torch`` (gather the blocks + SDPA: what paged_attention does without
the C kernels), ``old`` (the C kernel of ``--baseline-rev``, built from git), ``new`` (this tree's).
Reports per layer: median wall time, median process CPU time, KV bytes, the bound
KV bytes / read bandwidth (measured here with ``tokenline bench roofline``'s method, or given with
``--bandwidth-gbs``) and time / bound; and time / paired bound, where each repeat's bandwidth is
that of the streaming pass just before it (the machine may be shared: neighbours slow both alike).

    .venv/bin/python bench/decode_attention.py
    .venv/bin/python bench/decode_attention.py --grid 32x320 --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F

from tokenline.bench.machine_probes import measure_bandwidth
from tokenline.bench.roofline import (
    cpu_sample,
    others_cpu_share,
    parse_size,
)
from tokenline.model import cpu_kernels
from tokenline.model.attention import _gather_tables

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DEFAULT_BASELINE = "80198e2"  # the previous round's kernel (1.27 ms a layer at 32 x 320 in the engine)


def old_kernels(rev: str) -> cpu_kernels.CpuKernels | None:
    """The decode-attention kernel of C source at git revision ``rev``, or None without git/compiler."""
    try:
        library, source = cpu_kernels.build_revision(rev)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"no baseline kernel ({rev}): {exc}", file=sys.stderr)
        return None
    # Bind only the attention entry point: an old library may lack later kernels.
    kernels = cpu_kernels.CpuKernels.__new__(cpu_kernels.CpuKernels)
    lib = ctypes.CDLL(str(library))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64  # as CpuKernels binds it
    # Since --kv-cache-dtype the entry point takes the KV dtype after the queries' one.
    two_dtypes = "tl_decode_attention(int dtype, int kv_dtype" in source
    lib.tl_decode_attention.argtypes = [ctypes.c_int, *([ctypes.c_int] if two_dtypes else []), ptr, i64, ptr, ptr,
                                        ptr, i64, ptr, ptr, *[i64] * 6, ctypes.c_float]
    lib.tl_decode_attention.restype = None
    kernels._lib = lib if two_dtypes else _OneDtype(lib)
    kernels.path = library
    return kernels


class _OneDtype:
    """An old library's tl_decode_attention called as the new one: the KV dtype (always the
    queries' here) dropped."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def tl_decode_attention(self, dtype: int, kv_dtype: int, *args: object) -> None:
        assert kv_dtype == dtype, "a kernel before --kv-cache-dtype reads caches in the queries' dtype"
        self._lib.tl_decode_attention(dtype, *args)


def torch_decode(q, k_cache, v_cache, tables, lens, max_len, scale):
    """paged_attention's path without the C kernel: gather the blocks, mask, SDPA."""
    keys, values = _gather_tables(k_cache, tables), _gather_tables(v_cache, tables)
    cols = torch.arange(tables.shape[1] * k_cache.shape[1])
    mask = (cols[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True, scale=scale)
    return out.squeeze(2)


class Case:
    """``layers`` separate caches holding ``batch`` sequences of ``context`` tokens each, blocks shuffled."""

    def __init__(self, batch: int, context: int, layers: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> None:
        generator = torch.Generator().manual_seed(seed)
        width = math.ceil(context / BLOCK)
        num_blocks = batch * width + 8
        self.batch, self.context, self.width = batch, context, width
        self.lens = torch.full((batch,), context, dtype=torch.int64)
        self.dtype = dtype
        self.q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.layers = []
        for _ in range(layers):
            kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
            tables = torch.randperm(num_blocks, generator=generator)[: batch * width].view(batch, width).contiguous()
            self.layers.append((kv[0], kv[1], tables))

    @property
    def kv_bytes(self) -> int:
        """What one layer must read: K and V of every cached token."""
        return 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * self.dtype.itemsize

    def run(self, fn: Callable, layer: int) -> torch.Tensor:
        k_cache, v_cache, tables = self.layers[layer]
        return fn(self.q, k_cache, v_cache, tables, self.lens, self.context, 1 / math.sqrt(HEAD_DIM))


@dataclass
class Timing:
    wall_s: float  # median per layer
    cpu_s: float  # median process CPU time per layer (all threads)
    bandwidth_gbs: float  # median read bandwidth of the eviction pass just before each timed pass
    x_paired_bound: float  # median over repeats of time / (KV bytes / that repeat's bandwidth)
    # The same with process CPU time on both sides (CPU seconds per byte, kernel / streaming pass):
    # on a shared machine this leaves out the time either spent descheduled.
    x_paired_cpu: float


def time_path(case: Case, fn: Callable, repeats: int, evict: torch.Tensor) -> Timing:
    """Passes through every layer, each after streaming ``evict`` (more than the last-level cache,
    so the KV comes from memory). The streaming pass is timed too: it is the "sum" method of
    ``tokenline bench roofline``, so each repeat carries its own bandwidth, measured under the same
    neighbours as the kernel right after it."""
    walls, cpus, bandwidths, ratios, cpu_ratios = [], [], [], [], []
    evict_bytes = evict.numel() * evict.element_size()
    for layer in range(len(case.layers)):  # warm-up: page in, build caches of the path
        case.run(fn, layer)
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        evict.sum()
        bandwidth = evict_bytes / (time.perf_counter() - start)
        evict_cpu = time.process_time() - start_cpu
        wall, cpu = time.perf_counter(), time.process_time()
        for layer in range(len(case.layers)):
            case.run(fn, layer)
        walls.append((time.perf_counter() - wall) / len(case.layers))
        cpus.append((time.process_time() - cpu) / len(case.layers))
        bandwidths.append(bandwidth / 1e9)
        ratios.append(walls[-1] / (case.kv_bytes / bandwidth))
        cpu_ratios.append(cpus[-1] / case.kv_bytes / (evict_cpu / evict_bytes))
    return Timing(statistics.median(walls), statistics.median(cpus), statistics.median(bandwidths),
                  statistics.median(ratios), statistics.median(cpu_ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", default="1x320,8x320,32x320,32x1024", help="batch x context, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-layers", type=int, default=30, help="layers per pass (SmolLM2-135M has 30)")
    parser.add_argument("--layer-bytes-cap", default="256MB", help="fewer layers when their KV would exceed this")
    parser.add_argument("--bandwidth-bytes", default="1GiB", help="buffer for the bandwidth measurement")
    parser.add_argument("--bandwidth-gbs", type=float, help="use this read bandwidth instead of measuring it")
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE, help="git revision of the old C kernel")
    parser.add_argument("--no-torch", action="store_true", help="skip the gather + SDPA path")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="of the KV cache and queries (float32: what a CPU without native bf16 serves)")
    parser.add_argument("--threads", type=int, help="torch/OpenMP threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the results here as well")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    new = cpu_kernels.load()
    if new is None:
        sys.exit("the C kernels are unavailable here (no compiler, or TOKENLINE_CPU_KERNELS=0)")
    paths: dict[str, Callable] = {}
    if not args.no_torch:
        paths["torch"] = torch_decode
    old = old_kernels(args.baseline_rev)
    if old is not None:
        paths["old"] = old.decode_attention
    paths["new"] = new.decode_attention

    load_before = os.getloadavg()[0]
    start = cpu_sample()
    if args.bandwidth_gbs:
        bandwidth = {"gb_per_s": args.bandwidth_gbs, "method": "given"}
    else:
        measured = measure_bandwidth(parse_size(args.bandwidth_bytes))
        bandwidth = {"gb_per_s": measured.gb_per_s, "method": measured.method, "by_method": measured.by_method}
    gbs = bandwidth["gb_per_s"]
    evict = torch.rand(256 * (1 << 20) // 4)  # random: no shared zero page, nothing for the host to merge
    cap = parse_size(args.layer_bytes_cap)
    print(f"torch threads {torch.get_num_threads()}, read bandwidth {gbs:.1f} GB/s ({bandwidth['method']}), "
          f"load average {load_before:.2f}")
    print("per layer: wall us (median), process CPU us, x bnd = time / (KV bytes / bandwidth measured above), "
          "x pair = the same with the bandwidth of the streaming pass just before each repeat, "
          "x cpu = CPU time per KV byte / the streaming pass's CPU time per byte")
    header = f"{'batch x ctx':>12} {'layers':>6} {'KV MB':>6} {'bound us':>8} " + " ".join(
        f"{name + ' us':>8} {'cpu':>6} {'x bnd':>5} {'x pair':>6} {'x cpu':>5}" for name in paths)
    print(header)
    rows = []
    for cell in args.grid.split(","):
        batch, context = (int(x) for x in cell.lower().split("x"))
        dtype = getattr(torch, args.dtype)
        probe = Case(batch, context, 1, seed=0, dtype=dtype)
        layers = max(1, min(args.max_layers, cap // probe.kv_bytes))
        case = Case(batch, context, layers, seed=batch * 1000 + context, dtype=dtype)
        bound_s = case.kv_bytes / (gbs * 1e9)
        reference = case.run(paths["new"], 0).float()
        row = {"batch": batch, "context": context, "layers": layers, "kv_bytes": case.kv_bytes,
               "bound_us": bound_s * 1e6, "paths": {}}
        for name, fn in paths.items():
            diff = (case.run(fn, 0).float() - reference).abs().max().item()
            timing = time_path(case, fn, args.repeats, evict)
            row["paths"][name] = {**asdict(timing), "x_bound": timing.wall_s / bound_s, "max_abs_diff_vs_new": diff}
        rows.append(row)
        print(f"{cell:>12} {layers:>6} {case.kv_bytes / 1e6:>6.2f} {bound_s * 1e6:>8.0f} " + " ".join(
            f"{p['wall_s'] * 1e6:>8.0f} {p['cpu_s'] * 1e6:>6.0f} {p['x_bound']:>5.2f} {p['x_paired_bound']:>6.2f} "
            f"{p['x_paired_cpu']:>5.2f}"
            for p in row["paths"].values()))
        del case
    share = others_cpu_share(start, cpu_sample())
    note = f"other processes took {share:.0%} of the machine meanwhile" if share is not None else ""
    print(f"load average after {os.getloadavg()[0]:.2f}; {note}")
    if "old" in paths:
        for row in rows:
            p = row["paths"]
            print(f"{row['batch']}x{row['context']}: new / old = {p['new']['wall_s'] / p['old']['wall_s']:.2f} "
                  f"(cpu {p['new']['cpu_s'] / p['old']['cpu_s']:.2f})")
    if args.json:
        args.json.write_text(json.dumps({
            "bandwidth": bandwidth, "torch_threads": torch.get_num_threads(), "load_avg_before": load_before,
            "others_cpu_share": share, "baseline_rev": args.baseline_rev, "rows": rows,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()

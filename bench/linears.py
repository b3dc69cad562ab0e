"""A decode step's linears against their roofline: our panel kernel and MKL's sgemm side by side.

The issue's target for small-batch GEMM: the linears at 8-64 rows within 1.5x max(weight bytes /
bandwidth, FLOPs / matmul peak). This times exactly that work, float32, without the rest of the
step: x [rows, K] through every layer's four projections (q|k|v, o, gate|up, down) of a stack of
random weights shaped like the default model's (SmolLM2-135M: 30 layers, hidden 576, intermediate
1536, 9 query / 3 KV heads of 64), distinct per layer so that, as in a real step, the weights come
from memory. Paths, alternating in one run: ``panels`` (``tl_linear_panels_f32`` over the weights
repacked into 16-column panels, what the model serves) and ``mkl`` (``F.linear``, torch's sgemm on
the plain weights). Bandwidth and peak are measured here with ``tokenline bench roofline``'s methods.

    .venv/bin/python bench/linears.py
    .venv/bin/python bench/linears.py --rows 8 32 --repeats 9 --json out.json
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
import torch.nn.functional as F

from tokenline.bench.machine_probes import measure_bandwidth, measure_matmul_gflops
from tokenline.bench.roofline import roofline_bound
from tokenline.model import cpu_kernels, panel_weight


def layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(out, in) of a Llama layer's projections as the model merges them."""
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * intermediate, hidden),
            (hidden, intermediate)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--shape", type=int, nargs=5, default=[576, 1536, 9, 3, 64],
                        metavar=("HIDDEN", "INTERMEDIATE", "HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        sys.exit("no C compiler: the CPU kernels cannot be built here")
    generator = torch.Generator().manual_seed(0)
    shapes = layer_shapes(*args.shape)
    plain = [[torch.randn(n, k, generator=generator) * 0.05 for n, k in shapes] for _ in range(args.layers)]
    panels = [[panel_weight.pack(w) for w in layer] for layer in plain]
    weight_bytes = sum(w.numel() * 4 for layer in plain for w in layer)
    bandwidth = measure_bandwidth(2 << 30).gb_per_s * 1e9
    peak = measure_matmul_gflops(torch.float32) * 1e9
    print(f"{args.layers} layers x {shapes}: {weight_bytes / 1e6:.0f} MB of float32 weights; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matmul peak {peak / 1e9:.0f} GFLOP/s, "
          f"{torch.get_num_threads()} threads")

    def run_panels(x: dict[int, torch.Tensor]) -> None:
        for layer in panels:
            for (n, k), p in zip(shapes, layer):
                kernels.linear_panels_f32(x[k], p, n)

    def run_mkl(x: dict[int, torch.Tensor]) -> None:
        for layer in plain:
            for w in layer:
                F.linear(x[w.shape[1]], w)

    paths: dict[str, Callable[[dict[int, torch.Tensor]], None]] = {"panels": run_panels, "mkl": run_mkl}
    results = []
    print("| rows | GFLOP | bound ms | limit | panels ms | panels / bound | panels GFLOP/s | mkl ms | mkl / bound |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            x = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in shapes}}
            flops = 2 * rows * sum(n * k for n, k in shapes) * args.layers
            bound = roofline_bound(weight_bytes, flops, bandwidth, peak)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for name, fn in paths.items():
                fn(x)  # warm-up (and first-touch of any buffers)
            for _ in range(args.repeats):
                for name, fn in paths.items():  # alternating: a noisy neighbour slows both alike
                    start = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            row = {"rows": rows, "gflop": flops / 1e9, "bound_ms": bound.seconds * 1e3, "limit": bound.limit,
                   **{f"{name}_ms": s * 1e3 for name, s in med.items()}}
            results.append(row)
            print(f"| {rows} | {flops / 1e9:.2f} | {bound.seconds * 1e3:.1f} | {bound.limit} | {med['panels'] * 1e3:.1f} | "
                  f"{med['panels'] / bound.seconds:.2f}x | {flops / med['panels'] / 1e9:.0f} | {med['mkl'] * 1e3:.1f} | "
                  f"{med['mkl'] / bound.seconds:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gbs": bandwidth / 1e9, "peak_gflops": peak / 1e9,
                                         "weight_mb": weight_bytes / 1e6, "rows": results}, indent=2))


if __name__ == "__main__":
    main()

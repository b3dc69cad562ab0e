"""Quantized linears (``-q q8_0`` / ``-q q4_1``) against the bfloat16 ones at decode batch sizes.

What a decode step multiplies: x [rows, K] bfloat16 through a layer's four projections (q|k|v, o,
gate|up, down), through ``Linear.forward`` as the model calls it: bf16 weights packed for oneDNN
(our streaming kernel below ``layers.small_batch_rows()``), or held as ggml blocks (Q8_0, Q4_1). The
weights are random, distinct per layer, with enough layers that the stack overflows the caches (the
weights come from memory, as in a real step). All formats alternate in one process, so a noisy
neighbour slows all alike. Prints the median time of one layer's four projections per format and
row count, and each quantized format's ratio to bf16 (< 1: faster).

    .venv/bin/python bench/quant_batched.py
    .venv/bin/python bench/quant_batched.py --models smollm2-135m --rows 1 8 16 32 --repeats 15
    # on a shared machine: one thread, timed by its own CPU clock (time others take does not count)
    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_batched.py --threads 1 --clock cpu
    # beside the packed layout (tl_linear_qp), the same blocks in ggml's order (the kernels before it)
    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_batched.py --threads 1 --clock cpu --blocks
    # prefill chunks: beside tl_linear_qp, the path long chunks took before (a dequantized copy per call)
    .venv/bin/python bench/quant_batched.py --rows 256 512 1024 --dequantized
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F

from tokenline.model import cpu_kernels
from tokenline.model.layers import Linear
from tokenline.model.quantization import QuantizedWeight

from linears import layer_shapes  # noqa: E402  (bench/, this script's own directory)

# (hidden, intermediate, heads, kv_heads, head_dim)
MODELS = {"smollm2-135m": (576, 1536, 9, 3, 64), "llama-3.2-1b": (2048, 8192, 32, 8, 64)}
FORMATS = ("bf16", "q8_0", "q4_1")
BLOCKS = "-blocks"  # a format's name + this: held in ggml's order (no packed panels)
DEQUANTIZED = "-dequant"  # ... or this: multiplied through a bfloat16 copy dequantized per call
STACK_BYTES = 96 << 20  # bf16 bytes of weights per format: past the last-level cache


class DequantizedPerCall:
    """A quantized Linear multiplied as long prefill chunks were before tl_linear_qp took them: the
    blocks unpacked and dequantized to a float32 matrix, rounded to bfloat16, then oneDNN."""

    def __init__(self, linear: Linear) -> None:
        self.linear = linear
        self.in_features = linear.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, kernels = self.linear._quantized, self.linear._kernels
        assert q is not None and kernels is not None
        weight = kernels.dequantize_q(q.ggml_blocks(), q.code, q.out_features, q.in_features)
        return F.linear(x, weight.to(torch.bfloat16))


def build(fmt: str, shapes: list[tuple[int, int]], layers: int, generator: torch.Generator) -> list[list[Any]]:
    stack = []
    for _ in range(layers):
        row = []
        for n, k in shapes:
            lin = Linear(k, n, bias=False)
            with torch.no_grad():
                lin.weight = torch.nn.Parameter((torch.randn(n, k, generator=generator) * 0.05).bfloat16(),
                                                requires_grad=False)
            if fmt == "bf16":
                lin.prepare_for_inference()
            else:
                assert lin.quantize_(fmt.removesuffix(BLOCKS).removesuffix(DEQUANTIZED))
                q = lin._quantized
                if fmt.endswith(BLOCKS) and q is not None and q.packed:
                    lin._quantized = QuantizedWeight(q.fmt, q.ggml_blocks(), q.out_features, q.in_features)
            row.append(DequantizedPerCall(lin) if fmt.endswith(DEQUANTIZED) else lin)
        stack.append(row)
    return stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=9, help="passes over the stack per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time (with --threads 1: robust to neighbours on a shared machine)")
    parser.add_argument("--blocks", action="store_true",
                        help="also time q8_0 / q4_1 held in ggml's block order (the kernels before the packed layout)")
    parser.add_argument("--dequantized", action="store_true",
                        help="also time q8_0 / q4_1 through a bfloat16 copy dequantized per call (long prefill "
                             "chunks before tl_linear_qp took them)")
    args = parser.parse_args()
    formats = FORMATS + ((f"q8_0{BLOCKS}", f"q4_1{BLOCKS}") if args.blocks else ())
    formats += (f"q8_0{DEQUANTIZED}", f"q4_1{DEQUANTIZED}") if args.dequantized else ()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if cpu_kernels.load() is None:
        sys.exit("no C compiler: the CPU kernels cannot be built here")
    print(f"threads {torch.get_num_threads()}, clock {args.clock}, avx512bf16 {cpu_kernels.cpu_has_native_bf16()}")
    generator = torch.Generator().manual_seed(0)
    for model in args.models:
        shapes = layer_shapes(*MODELS[model])
        layer_bytes = 2 * sum(n * k for n, k in shapes)
        layers = max(1, -(-STACK_BYTES // layer_bytes))
        stacks = {fmt: build(fmt, shapes, layers, generator) for fmt in formats}
        print(f"\n{model}: projections (out, in) {shapes}, {layers} distinct layers; ms per layer (median)")
        print(f"{'rows':>5} " + " ".join(f"{f:>12}" for f in formats) + "  " + " ".join(f"{f + '/bf16':>17}" for f in formats[1:]))
        for rows in args.rows:
            x = {k: torch.randn(rows, k, generator=generator).bfloat16() for k in {k for _, k in shapes}}
            times: dict[str, list[float]] = {fmt: [] for fmt in formats}
            with torch.inference_mode():
                for fmt in formats:  # warm-up (builds, first-touch)
                    for lin in stacks[fmt][0]:
                        lin(x[lin.in_features])
                for _ in range(args.repeats):
                    for fmt in formats:
                        start = clock()
                        for layer in stacks[fmt]:
                            for lin in layer:
                                lin(x[lin.in_features])
                        times[fmt].append((clock() - start) * 1e3 / layers)
            med = {fmt: statistics.median(t) for fmt, t in times.items()}
            print(f"{rows:>5} " + " ".join(f"{med[f]:12.3f}" for f in formats) + "  "
                  + " ".join(f"{med[f] / med['bf16']:17.2f}" for f in formats[1:]))
        del stacks


if __name__ == "__main__":
    main()

"""The streaming bfloat16 linear (``tl_linear_bf16_blocked``) against oneDNN and against an older
revision of itself, at decode-step row counts, on CPUs with native bf16 (AVX512-BF16).

What a bfloat16 decode step multiplies: x [rows, K] through every layer's four projections (q|k|v,
o, gate|up, down) of a stack of random weights shaped like the default model's (SmolLM2-135M: 30
layers, hidden 576, intermediate 1536, 9 query / 3 KV heads of 64), distinct per layer so that, as
in a real step, the weights come from memory; then the 49152-row LM head. Every weight is packed
once for oneDNN (model/packed_weight.py, as the model holds it) and all paths read those bytes:
``old`` (the C kernel of ``--baseline-rev``, built from git), ``new`` (this tree's) and ``onednn``
(``mkldnn._linear_pointwise``, what ``Linear`` calls past ``layers.small_batch_rows()``),
alternating in one process so that a noisy neighbour slows all alike. Reports medians per layer
(the four projections) and for the head, and whether old and new gave the same bits.

    .venv/bin/python bench/linears_bf16.py
    .venv/bin/python bench/linears_bf16.py --rows 8 16 32 64 --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from tokenline.model import cpu_kernels
from tokenline.model.layers import PACKED_BATCH_HINT
from tokenline.model.packed_weight import PackedWeight, pack

from linears import layer_shapes  # noqa: E402  (bench/, this script's own directory)

DEFAULT_BASELINE = "5b1cae3"  # before the many-row path (one thread per whole column block, 4-row tiles)
VOCAB = 49152

Linear = Callable[[torch.Tensor, PackedWeight, torch.Tensor], None]


def blocked_linear(library: Path) -> Linear:
    """y = x @ w.T through ``tl_linear_bf16_blocked`` of ``library`` (bound alone: an old library may
    lack later kernels)."""
    fn = ctypes.CDLL(str(library)).tl_linear_bf16_blocked
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    fn.restype = None

    def run(x: torch.Tensor, w: PackedWeight, y: torch.Tensor) -> None:
        assert w.layout is not None
        fn(x.data_ptr(), w.tiles.data_ptr(), y.data_ptr(), x.shape[0], w.out_features, x.shape[1],
           w.layout.block_n, w.layout.pairs)

    return run


def old_library(rev: str) -> Path | None:
    try:
        return cpu_kernels.build_revision(rev)[0]
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"no baseline kernel ({rev}): {exc}", file=sys.stderr)
        return None


def bits_expected_same(rows: int, block_ns: list[int]) -> bool:
    """Whether the old kernel's outputs are the new one's bits. Below TL_BLOCKED_MANY_ROWS (12) both take
    the same path. From there each new output is one dpbf16 chain; the old 4-row tiles are one chain only
    with 64-column blocks (with 16 or 32, four rows hold at most 8 accumulators, which the old kernel
    split into even and odd pairs summed at the end), and its tail tile of 1-3 rows always splits."""
    return rows < 12 or (rows % 4 == 0 and min(block_ns) >= 64)


def onednn(x: torch.Tensor, w: PackedWeight, y: torch.Tensor) -> None:
    y.copy_(torch.ops.mkldnn._linear_pointwise(x, w.onednn, None, "none", [], ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 12, 16, 32, 64])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--shape", type=int, nargs=5, default=[576, 1536, 9, 3, 64],
                        metavar=("HIDDEN", "INTERMEDIATE", "HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE, help="git revision of the old C kernel")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cpu_kernels.load() is None or not cpu_kernels.cpu_has_native_bf16():
        sys.exit("needs the CPU kernels and a CPU with native bf16 (oneDNN packs bf16 weights only there)")
    paths: dict[str, Linear] = {"new": blocked_linear(cpu_kernels.build()), "onednn": onednn}
    old = old_library(args.baseline_rev)
    if old is not None:
        paths = {"old": blocked_linear(old), **paths}
    generator = torch.Generator().manual_seed(0)

    def packed(n: int, k: int) -> PackedWeight:
        weight = pack((torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16), PACKED_BATCH_HINT)
        if weight.layout is None:
            sys.exit("oneDNN chose a packed layout the kernel does not read")
        return weight

    shapes = layer_shapes(*args.shape)
    layers = [[packed(n, k) for n, k in shapes] for _ in range(args.layers)]
    head = packed(VOCAB, args.shape[0])
    print(f"{args.layers} layers x {shapes} + a {VOCAB}-row head, bfloat16; {torch.get_num_threads()} threads; "
          f"old = {args.baseline_rev if old else 'not built'}")
    names = list(paths)
    print("| rows | " + " | ".join(f"{n} layer µs" for n in names) + " | " + " | ".join(f"{n} head ms" for n in names)
          + " | new / old (layer, head) | new / onednn (layer, head) | old = new bits |")
    print("|---:|" + "---:|" * (2 * len(names)) + "---|---|---|")
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            x = {k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for k in {k for _, k in shapes}}
            outs = {name: [torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in shapes] for name in names}
            head_outs = {name: torch.empty(rows, VOCAB, dtype=torch.bfloat16) for name in names}
            hx = torch.randn(rows, args.shape[0], generator=generator).to(torch.bfloat16)
            layer_t: dict[str, list[float]] = {name: [] for name in names}
            head_t: dict[str, list[float]] = {name: [] for name in names}
            for repeat in range(args.repeats + 1):  # the first pass warms up
                for name, fn in paths.items():
                    start = time.perf_counter()
                    for layer in layers:
                        for (_, k), w, y in zip(shapes, layer, outs[name], strict=True):
                            fn(x[k], w, y)
                    mid = time.perf_counter()
                    fn(hx, head, head_outs[name])
                    end = time.perf_counter()
                    if repeat:
                        layer_t[name].append((mid - start) / args.layers)
                        head_t[name].append(end - mid)
            lay = {name: statistics.median(t) for name, t in layer_t.items()}
            hd = {name: statistics.median(t) for name, t in head_t.items()}
            pairs = list(zip(outs["old"], outs["new"], strict=True)) + [(head_outs["old"], head_outs["new"])] \
                if "old" in names else []
            same = bool(pairs) and all(torch.equal(a, b) for a, b in pairs)
            # Largest old/new difference over each output's largest magnitude: bf16 rounding is 2^-8.
            diff = max((float((a.float() - b.float()).abs().max() / a.float().abs().max()) for a, b in pairs),
                       default=None)
            vs_old = f"{lay['new'] / lay['old']:.2f}x, {hd['new'] / hd['old']:.2f}x" if "old" in names else ""
            print(f"| {rows} | " + " | ".join(f"{lay[n] * 1e6:.0f}" for n in names) + " | "
                  + " | ".join(f"{hd[n] * 1e3:.2f}" for n in names)
                  + f" | {vs_old} | {lay['new'] / lay['onednn']:.2f}x, {hd['new'] / hd['onednn']:.2f}x | {same} |",
                  flush=True)
            results.append({"rows": rows, "layer_s": lay, "head_s": hd, "same_bits": same,
                            "bits_expected_same": bits_expected_same(rows, [w.layout.block_n for w in layers[0] + [head]]),
                            "max_rel_diff": diff})
    if args.json:
        args.json.write_text(json.dumps({"baseline_rev": args.baseline_rev, "shapes": shapes, "rows": results},
                                        indent=2))


if __name__ == "__main__":
    main()

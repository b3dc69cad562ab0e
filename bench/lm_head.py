"""Gemma 3's 262,144-row LM head and the sampler behind it, on this machine.

The head: a tied ``Linear(640, 262144)`` of random weights, prepared as the model holds it
(``layers.prepare_for_inference``: float32 column panels, bfloat16 packed for oneDNN and read by our
streaming kernel), timed at decode row counts; its achieved GB/s (weight bytes over the best time)
beside the machine's read bandwidth (``machine_probes.measure_bandwidth``, the same probe ``bench
roofline`` uses). The sampler: one step over [rows, 262144] bfloat16 logits for greedy, Gemma's
generation defaults (top_k=64, top_p=0.95), top-p alone, min-p alone, temperature alone and logprobs,
this tree's ``Sampler`` against ``--baseline-rev``'s (loaded from git). Every figure is the best of
``--repeats`` calls.

    .venv/bin/python bench/lm_head.py
    .venv/bin/python bench/lm_head.py --rows 1 8 32 --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
from torch import nn

from tokenline.bench.machine_probes import GB, measure_bandwidth
from tokenline.model.layers import Linear, prepare_for_inference
from tokenline.model.sampler import Sampler
from tokenline.sampling_params import SamplingParams

HIDDEN, VOCAB = 640, 262_144  # Gemma 3 270M
DEFAULT_BASELINE = "e0ec486"  # before the sampler's candidates for every filter

SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "gemma defaults (top_k 64, top_p 0.95)": {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
    "top_p 0.95 alone": {"temperature": 1.0, "top_p": 0.95},
    "min_p 0.05 alone": {"temperature": 1.0, "min_p": 0.05},
    "temperature 1 alone": {"temperature": 1.0},
    "greedy + logprobs 5": {"temperature": 0.0, "logprobs": 5},
}


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls after a warm-up: on a shared machine a median still holds the
    scheduler's time slices given to others (10-16 ms each, more than a whole sampler step)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


class TiedHead(nn.Module):
    """What ``prepare_for_inference`` sees of a model with a tied head: embed_tokens and lm_head."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        weight = (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN, _weight=weight)
        self.lm_head = Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def head_figures(rows_list: list[int], repeats: int, bandwidth: float) -> list[dict[str, object]]:
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        model = TiedHead(dtype)
        prepare_for_inference(model)
        head = model.lm_head
        weight_bytes = VOCAB * HIDDEN * dtype.itemsize
        with torch.inference_mode():
            for rows in rows_list:
                x = torch.randn(rows, HIDDEN).to(dtype)
                ms = best_ms(lambda: head(x), repeats)
                gbs = weight_bytes / (ms / 1e3) / GB
                out.append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "ms": ms, "gb_per_s": gbs,
                            "of_bandwidth": gbs / bandwidth, "weight_mb": weight_bytes / 1e6,
                            "floor_ms": weight_bytes / (bandwidth * GB) * 1e3})
        del model, head
    return out


def baseline_sampler(rev: str) -> ModuleType:
    """``tokenline/model/sampler.py`` of ``rev``, loaded as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:tokenline/model/sampler.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_baseline", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampler_baseline"] = module
    spec.loader.exec_module(module)
    return module


def model_like_logits(rows: int) -> torch.Tensor:
    """bfloat16 rows like a real model's: a few hundred plausible tokens well above a long tail."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, VOCAB, generator=gen) * 2.0
    logits[:, torch.randperm(VOCAB, generator=gen)[:300]] += 14.0 + torch.randn(rows, 300, generator=gen) * 2.0
    return logits.to(torch.bfloat16)


def sampler_figures(rows_list: list[int], repeats: int, baseline: ModuleType | None) -> list[dict[str, object]]:
    out = []
    for rows in rows_list:
        logits = model_like_logits(rows)
        for name, params in SAMPLINGS.items():
            figures: dict[str, object] = {"rows": rows, "sampling": name}
            for label, module in (("new", sys.modules[Sampler.__module__]), ("old", baseline)):
                if module is None:
                    continue
                sampling_rows = [module.SamplingRow(SamplingParams(**params).with_defaults(), [], [], None)
                                 for _ in range(rows)]
                metadata = module.SamplingMetadata.build(sampling_rows, VOCAB, torch.device("cpu"))
                sampler = module.Sampler(VOCAB)
                figures[f"{label}_ms"] = best_ms(lambda: sampler(logits, metadata), repeats)
            out.append(figures)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="the bandwidth probe's buffer, MB")
    p.add_argument("--baseline-rev", default=DEFAULT_BASELINE, help="git revision whose sampler to compare ('' none)")
    p.add_argument("--json", default=None, help="also write every figure here")
    args = p.parse_args()
    torch.manual_seed(0)
    bandwidth = measure_bandwidth(args.bandwidth_mb * 1_000_000).gb_per_s
    print(f"torch threads {torch.get_num_threads()}; read bandwidth {bandwidth:.1f} GB/s "
          f"({args.bandwidth_mb} MB buffer)")
    head = head_figures(args.rows, args.repeats, bandwidth)
    print("\n| head dtype | rows | ms | GB/s | of bandwidth | bandwidth floor ms |\n|---|---:|---:|---:|---:|---:|")
    for h in head:
        print(f"| {h['dtype']} | {h['rows']} | {h['ms']:.2f} | {h['gb_per_s']:.1f} | {100 * h['of_bandwidth']:.0f} % "
              f"| {h['floor_ms']:.2f} |")
    baseline = baseline_sampler(args.baseline_rev) if args.baseline_rev else None
    sampling = sampler_figures(args.rows, args.repeats, baseline)
    print(f"\n| sampler step, [rows, {VOCAB}] bf16 | rows | this tree ms | {args.baseline_rev or '-'} ms |\n"
          "|---|---:|---:|---:|")
    for s in sampling:
        old = f"{s['old_ms']:.2f}" if "old_ms" in s else "–"
        print(f"| {s['sampling']} | {s['rows']} | {s['new_ms']:.2f} | {old} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_gb_per_s": bandwidth, "head": head, "sampler": sampling,
                                               "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()

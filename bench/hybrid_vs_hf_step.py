"""tokenline's hybrid decode step against HF transformers' on the same weights, interleaved in one process.

For each batch size B: B random prompts are prefilled by both (tokenline's ``ModelRunner``; HF's
``model(input_ids, use_cache=True)``, a static batch, the best transformers does for this model
since its continuous batching refuses linear-attention layers), then decode steps alternate
tokenline, HF, tokenline, HF, ... so both see the same machine; the medians and their ratio are
printed. On a machine shared with other work the absolute times measure the neighbours too; the
ratio is the figure.

    .venv/bin/python bench/hybrid_vs_hf_step.py /tmp/tokenline-peers/models/qwen3.5-0.8b/hf --batch-sizes 1 8
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
from transformers import AutoModelForCausalLM

from tokenline.model.batch import ScheduledBatch, ScheduledSeq
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams

BLOCK_SIZE = 16


@torch.inference_mode()
def compare(runner: ModelRunner, hf: torch.nn.Module, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    sp = SamplingParams(temperature=0.0, max_tokens=prompt_len + steps + 2).with_defaults()
    per_seq = -(-(prompt_len + steps + 2) // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, 40000, (batch, prompt_len), generator=gen)
    seqs = [p.tolist() for p in prompts]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    t0 = time.perf_counter()
    out = runner.execute(ScheduledBatch([ScheduledSeq(f"s{i}", s, 0, tables[i], True, sp, state_slot=i)
                                         for i, s in enumerate(seqs)]))
    prefill_ours = time.perf_counter() - t0
    for i, s in enumerate(seqs):
        s.append(out[f"s{i}"].token_id)
    t0 = time.perf_counter()
    hf_out = hf(input_ids=prompts, use_cache=True)
    prefill_hf = time.perf_counter() - t0
    cache = hf_out.past_key_values
    last = hf_out.logits[:, -1].argmax(-1, keepdim=True)
    ours, theirs = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = runner.execute(ScheduledBatch([
            ScheduledSeq(f"s{i}", [s[-1]], len(s) - 1, tables[i], True, sp, state_slot=i) for i, s in enumerate(seqs)]))
        ours.append(time.perf_counter() - t0)
        for i, s in enumerate(seqs):
            s.append(result[f"s{i}"].token_id)
        t0 = time.perf_counter()
        hf_out = hf(input_ids=last, past_key_values=cache, use_cache=True)
        theirs.append(time.perf_counter() - t0)
        cache, last = hf_out.past_key_values, hf_out.logits[:, -1].argmax(-1, keepdim=True)
    return {"batch": batch, "prefill_ours_s": prefill_ours, "prefill_hf_s": prefill_hf,
            "step_ours_ms": 1e3 * statistics.median(ours), "step_hf_ms": 1e3 * statistics.median(theirs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HF-format directory of a hybrid model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = ModelRunner(Path(args.model), torch.bfloat16, max_model_len=4096)
    most = max(args.batch_sizes)
    runner.allocate_kv_cache(most * -(-(args.prompt_len + args.steps + 2) // BLOCK_SIZE), BLOCK_SIZE,
                             num_state_slots=most)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    with open("/proc/loadavg") as f:
        print(f"threads {torch.get_num_threads()}, load average {f.read().split()[0]} at start", flush=True)
    print("batch | prefill s ours / HF | decode step ms ours / HF | HF / ours (step)", flush=True)
    for b in args.batch_sizes:
        r = compare(runner, hf, b, args.prompt_len, args.steps)
        print(f"{b} | {r['prefill_ours_s']:.1f} / {r['prefill_hf_s']:.1f} | {r['step_ours_ms']:.0f} / "
              f"{r['step_hf_ms']:.0f} | {r['step_hf_ms'] / r['step_ours_ms']:.2f}", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average {f.read().split()[0]} at end")


if __name__ == "__main__":
    main()

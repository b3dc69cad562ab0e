"""A server-shaped workload timed by CPU clock: ``-q`` against bfloat16 where a shared machine spoils wall time.

N prompts of 256 random tokens, 64 greedy output tokens each, handed at once to an offline ``LLM``
(its engine runs in this process, so with one thread every kernel runs on this thread): the
scheduling of a server at concurrency N whose requests arrive together (chunks of the default
1,024-token budget, then batched decode). Prints the output tokens per CPU second of this thread,
which neighbours on the machine do not inflate (they still share its caches).

    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_offline.py bf16 32
    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_offline.py q8_0 8
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tokenline.llm import LLM
from tokenline.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights", choices=("bf16", "q8_0", "q4_1"), help="bf16, or the -q format")
    parser.add_argument("requests", type=int, nargs="?", default=32, help="prompts handed in at once")
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(None, dtype="bfloat16", quantization=None if args.weights == "bf16" else args.weights)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(args.requests + 2)]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.thread_time()
    outputs = llm.generate(prompts[2:], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    seconds = time.thread_time() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{args.weights} x {args.requests}: {seconds:.1f} CPU s, {tokens / seconds:.1f} output tokens a CPU second")


if __name__ == "__main__":
    main()

"""The peers' c=32 Gemma 3 workload through the offline engine, where each step's time goes.

32 prompts of 256 random tokens, 128 output tokens each (greedy, ignore_eos), all added at once as
the peers' c=32 run sends them: the prefill steps, then ~120 decode steps of 32 rows. Prints the wall
time, the other (prefill) steps' sum, and the median decode step split into the runner's parts (prepare,
embedding, layers, head, the rest). ``--hog BUSY_MS PERIOD_MS`` runs a busy-looping process beside
it (BUSY_MS of CPU every PERIOD_MS), standing in for the API process and the client that share a
server's cores.

    .venv/bin/python bench/gemma3_engine32.py --quantization q4_1
    .venv/bin/python bench/gemma3_engine32.py --quantization q4_1 --hog 2 15
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenline.llm import LLM  # noqa: E402
from tokenline.sampling_params import SamplingParams  # noqa: E402

HOG = ("import sys, time\n"
       "busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3\n"
       "while True:\n"
       "    t = time.monotonic()\n"
       "    while time.monotonic() - t < busy: pass\n"
       "    time.sleep(period)\n")


def timed(obj: Any, name: str, key: str, into: dict[str, float]) -> None:
    """Wrap ``obj.name`` to add its wall time to ``into[key]``."""
    original: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/tokenline/models/gemma3-270m"))
    parser.add_argument("--quantization", default=None, help="q4_1 or q8_0 (default: bfloat16 weights)")
    parser.add_argument("--hog", nargs=2, type=float, metavar=("BUSY_MS", "PERIOD_MS"), default=None)
    args = parser.parse_args()
    llm = LLM(args.model, **({"quantization": args.quantization} if args.quantization else {}))
    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    parts: dict[str, float] = defaultdict(float)
    for obj, name, key in ((runner, "_prepare", "prepare"), (model.embed_tokens, "forward", "embedding"),
                           (model, "_fused_decode", "layers"), (model, "compute_logits", "head"),
                           (runner, "execute", "execute")):
        timed(obj, name, key, parts)
    steps: list[tuple[float, int, dict[str, float]]] = []
    step = engine.step

    def timed_step() -> Any:
        parts.clear()
        start = time.perf_counter()
        outputs = step()
        steps.append((time.perf_counter() - start, len(outputs), dict(parts)))
        return outputs

    engine.step = timed_step  # type: ignore[method-assign]
    rng = random.Random(5)
    prompts = [[rng.randrange(1000, 200_000) for _ in range(256)] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    hog = subprocess.Popen([sys.executable, "-c", HOG, *map(str, args.hog)]) if args.hog else None
    try:
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    decode = [s for s in steps if s[1] == 32 and s[2].get("layers", 0) > 0]
    others = [s for s in steps if s not in decode]  # prefill chunks (with the first decodes beside them)
    print(f"wall {wall:.2f} s; {len(others)} other steps (prefill) {sum(s[0] for s in others):.2f} s; "
          f"{len(decode)} decode steps of 32, median {1e3 * statistics.median(s[0] for s in decode):.1f} ms")
    median = {k: 1e3 * statistics.median(s[2].get(k, 0.0) for s in decode)
              for k in ("prepare", "embedding", "layers", "head", "execute")}
    rest = median["execute"] - median["prepare"] - median["embedding"] - median["layers"] - median["head"]
    print("decode step medians, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in median.items() if k != "execute")
          + f", rest of execute {rest:.1f}")


if __name__ == "__main__":
    main()

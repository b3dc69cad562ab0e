"""Rolling a Gated DeltaNet layer's recurrent state back to the accepted drafts: three designs
measured on the delta rule itself (B sequences, each verifying 1 + k positions, float32, CPU),
against the step with no rollback at all (the chunked rule per span, writing the final state).

  writes     (what tokenline does) one chunk of the rule for all spans, keeping its per-token
             writes u_t; after acceptance the state after n tokens is formed once:
             exp(c_{n-1}) S0 + sum_{t<n} exp(c_{n-1} - c_t) k_t u_t^T
  per-state  the recurrent form position by position, keeping all 1 + k states, then selecting one
  recompute  the chunked rule per span as without rollback, a snapshot of the slot before it, and
             after acceptance the accepted tokens through the recurrent rule again from the snapshot

Reports process CPU milliseconds per step (the median of --repeat runs, one torch thread; the
machine may be shared, so wall time would include others' turns). The accepted counts are drawn at random per step.

    .venv/bin/python bench/hybrid_spec_rollback.py
    .venv/bin/python bench/hybrid_spec_rollback.py --shape 27b --batch 8 --drafts 4 --repeat 9
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tokenline.model.gated_deltanet import (  # noqa: E402
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_with_writes,
)

SHAPES = {  # (key heads, value heads, dk, dv)
    "tiny": (2, 4, 32, 32),
    "27b": (16, 48, 128, 128),
}


def inputs(shape: tuple[int, int, int, int], batch: int, length: int) -> dict[str, torch.Tensor]:
    hk, hv, dk, dv = shape
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(batch, length, hk, dk, generator=g),
        "k": torch.randn(batch, length, hk, dk, generator=g),
        "v": torch.randn(batch, length, hv, dv, generator=g),
        "g": -torch.rand(batch, length, hv, generator=g),
        "beta": torch.rand(batch, length, hv, generator=g),
        "slots": torch.randn(batch + 1, hv, dk, dv, generator=g) * 0.1,  # one spare row
    }


def writes(x: dict[str, torch.Tensor], counts: list[int]) -> None:
    rows = torch.arange(len(counts))
    out, kept = gated_delta_rule_with_writes(x["q"], x["k"], x["v"], x["g"], x["beta"], x["slots"][rows])
    x["slots"].index_copy_(0, rows, kept.states_after(rows, torch.tensor(counts)))


def per_state(x: dict[str, torch.Tensor], counts: list[int]) -> None:
    rows = torch.arange(len(counts))
    state = x["slots"][rows]
    states = []
    for t in range(x["q"].shape[1]):
        _, state = gated_delta_rule_recurrent(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t], state)
        states.append(state)
    chosen = torch.stack(states, 1)[rows, torch.tensor(counts) - 1]
    x["slots"].index_copy_(0, rows, chosen)


def recompute(x: dict[str, torch.Tensor], counts: list[int]) -> None:
    batch = len(counts)
    snapshot = x["slots"][:batch].clone()
    for b in range(batch):
        _, final = gated_delta_rule_chunked(x["q"][b], x["k"][b], x["v"][b], x["g"][b], x["beta"][b], x["slots"][b])
        x["slots"][b] = final
    # Acceptance known: the accepted tokens again, all sequences in lock-step from the snapshot.
    state, chosen = snapshot, snapshot.clone()
    for t in range(max(counts)):
        _, state = gated_delta_rule_recurrent(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t], state)
        done = torch.tensor([c == t + 1 for c in counts])
        chosen[done] = state[done]
    x["slots"][:batch] = chosen


def no_rollback(x: dict[str, torch.Tensor], counts: list[int]) -> None:
    for b in range(len(counts)):
        _, final = gated_delta_rule_chunked(x["q"][b], x["k"][b], x["v"][b], x["g"][b], x["beta"][b], x["slots"][b])
        x["slots"][b] = final


DESIGNS: dict[str, Callable[[dict[str, torch.Tensor], list[int]], None]] = {
    "no rollback": no_rollback, "writes": writes, "per-state": per_state, "recompute": recompute,
}


def cpu_ms(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: no spinning threads "
                        "inflating CPU time on a shared machine)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    results = []
    for name in SHAPES if args.shape == "all" else [args.shape]:
        for batch in args.batch:
            x = inputs(SHAPES[name], batch, 1 + args.drafts)
            counts = [rng.randint(1, 1 + args.drafts) for _ in range(batch)]
            row = {"shape": name, "batch": batch, "drafts": args.drafts}
            for design, fn in DESIGNS.items():
                row[design] = round(cpu_ms(lambda fn=fn: fn(x, counts), args.repeat), 3)
            results.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

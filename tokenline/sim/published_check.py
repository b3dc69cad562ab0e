"""Held against the world: published vLLM GPU measurements beside tokenline's predictions of the
same workloads (the accelerator step model, the real scheduler on a simulated clock, a closed-loop
client like ``vllm bench serve --max-concurrency``).

    python -m tokenline.sim.published_check docs/benchmarks/data/2026-12-07-published-vllm-gpu.json

prints the Markdown table of docs/benchmarks/2026-12-07-planner.md: every row's measured and
predicted figures, the error, and the hit rate within 25 % on output tok/s and TPOT.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.sim.accelerator import accelerator_cost
from tokenline.sim.fleet_plan import VLLM_MAX_NUM_BATCHED_TOKENS, build_replica
from tokenline.sim.machine import load_machine
from tokenline.sim.placeholder_runner import SimClock
from tokenline.sim.sim_target import SimTarget, read_model_config
from tokenline.sim.simulate import SimConfig, build_sim_core, report, run_closed_loop, workload_prompts

VLLM_MAX_NUM_SEQS = 256
MAX_SIMULATED_PROMPTS = 150  # enough for a p50 and a steady state; keeps a row to a second or two
HIT = 0.25
SCORED = ("output_tok_s", "tpot_ms")  # what the target counts; TTFT is shown beside them


@dataclass(frozen=True)
class Row:
    source: str
    model_config: str
    gpu: str
    tp: int
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    measured: dict[str, float]
    calibrated: bool = False
    note: str = ""


def load_rows(path: str | Path) -> tuple[dict[str, Any], list[Row]]:
    raw = json.loads(Path(path).read_text())
    return raw["sources"], [Row(**row) for row in raw["rows"]]


def predict(row: Row, base: Path) -> dict[str, float]:
    """The row's workload on its GPU: output tok/s, TPOT (mean), TTFT (mean and p50), in ms."""
    config = read_model_config(str(base / row.model_config))
    machine = load_machine(row.gpu)
    replica = build_replica(config, accelerator_cost(config, machine.dtype_size), machine, row.tp, VLLM_MAX_NUM_SEQS,
                            max_model_len=max(4096, row.input_len + row.output_len + 16))
    if replica is None:
        raise ValueError(f"{row.model_config} does not fit {row.tp} x {row.gpu}")
    target = SimTarget(replica.model, 0.0, Path(row.model_config).stem, config.vocab_size, replica.max_model_len,
                       replica.model.model.cost.kv_bytes_per_token, replica.num_kv_blocks, replica.num_state_slots,
                       machine.name, request_overhead_s=replica.request_overhead_s, windows=replica.windows)
    sim = SimConfig(concurrency=row.concurrency, num_prompts=min(row.num_prompts, MAX_SIMULATED_PROMPTS),
                    input_len=row.input_len, output_len=row.output_len, max_num_seqs=VLLM_MAX_NUM_SEQS,
                    max_num_batched_tokens=VLLM_MAX_NUM_BATCHED_TOKENS, num_kv_blocks=replica.num_kv_blocks)
    clock = SimClock()
    core = build_sim_core(target, sim, clock)
    run = run_closed_loop(core, workload_prompts(sim, target.vocab_size), sim.output_len, sim.concurrency,
                          replica.request_overhead_s, clock.wait_until)
    r = report(run, sim, target.model, "simulated")
    return {"output_tok_s": r.total_output_tokens / r.duration_s, "tpot_ms": r.tpot_ms["mean"] or 0.0,
            "ttft_ms": r.ttft_ms["mean"] or 0.0, "ttft_p50_ms": r.ttft_ms["p50"] or 0.0}


@dataclass(frozen=True)
class Comparison:
    row: Row
    predicted: dict[str, float]

    def errors(self) -> dict[str, float]:
        """Relative error of each measured figure: (predicted − measured) / measured."""
        return {k: (self.predicted[k] - v) / v for k, v in self.row.measured.items() if v}

    def hits(self) -> dict[str, bool]:
        return {k: abs(e) <= HIT for k, e in self.errors().items() if k in SCORED}


def compare(path: str | Path) -> list[Comparison]:
    base = Path(path).parent
    _, rows = load_rows(path)
    return [Comparison(row, predict(row, base)) for row in rows]


def hit_rate(comparisons: list[Comparison]) -> tuple[int, int]:
    """Scored figures within 25 %, of all scored figures, over the rows not calibrated on."""
    hits = [h for c in comparisons if not c.row.calibrated for h in c.hits().values()]
    return sum(hits), len(hits)


def markdown(comparisons: list[Comparison]) -> str:
    head = ("| source | model | GPU × TP | in / out | c | measured | predicted | error |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for c in comparisons:
        r = c.row
        errors = c.errors()
        fmt = {k: f"{k} {v:,.1f}" for k, v in r.measured.items()}
        pred = {k: f"{k} {c.predicted[k]:,.1f}" for k in r.measured}
        err = ", ".join(f"{k} {e:+.0%}{'' if k not in SCORED else (' ✓' if abs(e) <= HIT else ' ✗')}"
                        for k, e in errors.items())
        lines.append(f"| {r.source}{' (calibrated on)' if r.calibrated else ''} | {Path(r.model_config).stem} | "
                     f"{r.gpu} × {r.tp} | {r.input_len} / {r.output_len} | {r.concurrency} | "
                     f"{'; '.join(fmt.values())} | {'; '.join(pred.values())} | {err} |")
    hits, total = hit_rate(comparisons)
    lines.append("")
    lines.append(f"Within 25 % on output tok/s and TPOT (rows not calibrated on): {hits} of {total}"
                 f" ({hits / max(total, 1):.0%}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m tokenline.sim.published_check ROWS.json", file=sys.stderr)
        return 2
    print(markdown(compare(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""compare.py's markdown report: issue 17's table once per client, ratios tokenline / vLLM per row,
then every run (attempts included) with the CPU its neighbours took and whether it was kept.

A system's result (``results[name]``) holds ``cold_start_s``, ``peak_rss_bytes``, an optional
``error`` and ``runs``: one record per attempt, ``{"scenario", "client", "attempt", "seed",
"metrics": RunMetrics.to_dict() | None, "neighbour": NeighbourCpu.to_dict() | None,
"verdict": "accepted" | "rejected" | "error", "reason"}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLIENT_TITLES = {"vllm": "`vllm bench serve` (vLLM's client)", "tokenline": "`tokenline bench serve`"}
REJECTED = "✗"  # the run's neighbours took more CPU than allowed: shown, never trusted


@dataclass(frozen=True)
class Row:
    label: str
    scenario: str
    key: str  # in RunMetrics
    spec: str


# Each concurrency scenario's figures: (label, RunMetrics key, format).
LOAD_FIGURES = [("output tok/s", "output_throughput", ".1f"), ("TPOT p50 ms", "tpot_p50_ms", ".1f"),
                ("TTFT p50 ms", "ttft_p50_ms", ".0f")]
ROWS = [
    *(Row(f"c={c} {label}", f"c{c}", key, spec) for c in (1, 8, 32) for label, key, spec in LOAD_FIGURES),
    Row("batch-1 decode, 32 in / 256 out: tok/s", "decode", "output_throughput", ".1f"),
    Row("batch-1 decode TPOT p50 ms", "decode", "tpot_p50_ms", ".1f"),
    Row("c=8, 192 of 256 tokens shared: output tok/s", "prefix-c8", "output_throughput", ".1f"),
    Row("c=8, 192 of 256 tokens shared: TTFT p50 ms", "prefix-c8", "ttft_p50_ms", ".0f"),
    # Long prompts: prefill-bound; "prompt tok/s" is prompt tokens over the run's wall time (see the notes).
    *(Row(f"{title}: {label}", scenario, key, spec)
      for scenario, title in (("long-c4", "c=4, 2048 in / 128 out"), ("long-c16", "c=16, 2048 in / 128 out"),
                              ("chat", "chat, 6 turns to ~4k history, c=4"))
      for label, key, spec in (("output tok/s", "output_throughput", ".1f"), ("TTFT p50 ms", "ttft_p50_ms", ".0f"),
                               ("TTFT p99 ms", "ttft_p99_ms", ".0f"), ("prompt tok/s", "prompt_throughput", ".0f"))),
]


@dataclass(frozen=True)
class Cell:
    value: float | None
    rejected: bool  # from a rejected run (no accepted attempt)
    error: str = ""


def chosen_run(runs: list[dict[str, Any]], scenario: str, client: str) -> dict[str, Any] | None:
    """The run a table cell shows: the last accepted attempt, else the last one with figures."""
    mine = [r for r in runs if r["scenario"] == scenario and r["client"] == client]
    for verdict in ("accepted", "rejected"):
        kept = [r for r in mine if r["verdict"] == verdict and r.get("metrics")]
        if kept:
            return kept[-1]
    return mine[-1] if mine else None


def cell(result: dict[str, Any], row: Row, client: str) -> Cell | None:
    run = chosen_run(result.get("runs", []), row.scenario, client)
    if run is None:
        return None
    if not run.get("metrics"):
        return Cell(None, False, run.get("reason") or "error")
    return Cell(run["metrics"].get(row.key), run["verdict"] != "accepted")


def _fmt(c: Cell | None, spec: str) -> str:
    if c is None:
        return "–"
    if c.error:
        return "error"
    if c.value is None:
        return "–"
    return format(c.value, spec) + (f" {REJECTED}" if c.rejected else "")


def _ratio(a: Cell | None, b: Cell | None) -> str:
    if a is None or b is None or a.value is None or b.value is None or b.value == 0:
        return "–"
    return f"{a.value / b.value:.2f}" + (f" {REJECTED}" if a.rejected or b.rejected else "")


def _server_ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def client_table(results: dict[str, dict[str, Any]], client: str) -> list[str]:
    """Issue 17's table for one client: a column per system, then tokenline / vLLM per tokenline
    system when vLLM ran."""
    names = list(results)
    ours = [n for n in names if n.startswith("tokenline")] if "vllm" in names else []
    head = ["", *names, *[f"{n} / vLLM" for n in ours]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    scenarios = {r["scenario"] for res in results.values() for r in res.get("runs", []) if r["client"] == client}
    for row in ROWS:
        if row.scenario not in scenarios:
            continue
        cells = {n: cell(results[n], row, client) for n in names}
        lines.append("| " + " | ".join([row.label, *[_fmt(cells[n], row.spec) for n in names],
                                          *[_ratio(cells[n], cells["vllm"]) for n in ours]]) + " |")
    rss = {n: results[n].get("peak_rss_bytes") or None for n in names}
    cold = {n: results[n].get("cold_start_s") for n in names}
    lines.append("| " + " | ".join(["peak RSS, server tree GB", *["–" if rss[n] is None else f"{rss[n] / 1e9:.2f}"
                                                                  for n in names],
                                    *[_server_ratio(rss[n], rss["vllm"]) for n in ours]]) + " |")
    lines.append("| " + " | ".join(["cold start (launch → /health 200) s",
                                    *["–" if cold[n] is None else f"{cold[n]:.1f}" for n in names],
                                    *[_server_ratio(cold[n], cold["vllm"]) for n in ours]]) + " |")
    return lines


def _pct(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.1f} %"


def runs_table(results: dict[str, dict[str, Any]]) -> list[str]:
    # Prompt tokens over the run, as the server's usage counted them: the same prompts must come to
    # the same count on every server (see the special-token note in compare.py).
    lines = [("| system | client | scenario | attempt | seed | ok | prompt tokens | out tok/s | TTFT p50 ms | "
              "TPOT p50 ms | wall s | server CPU s | client CPU s | harness CPU s | neighbours | of which steal | "
              "verdict |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, result in results.items():
        for run in result.get("runs", []):
            m = run.get("metrics") or {}
            n = run.get("neighbour") or {}

            def num(d: dict[str, Any], key: str, spec: str) -> str:
                v = d.get(key)
                return "–" if v is None else format(v, spec)

            ok = f"{m['completed']}/{m['num_prompts']}" if m else "–"
            verdict = run["verdict"] + (f": {run['reason']}" if run.get("reason") else "")
            lines.append(f"| {name} | {run['client']} | {run['scenario']} | {run['attempt']} | {run['seed']} | {ok} | "
                         f"{num(m, 'total_input_tokens', 'd')} | {num(m, 'output_throughput', '.1f')} | "
                         f"{num(m, 'ttft_p50_ms', '.0f')} | "
                         f"{num(m, 'tpot_p50_ms', '.1f')} | {num(n, 'wall_s', '.1f')} | {num(n, 'server_s', '.1f')} | "
                         f"{num(n, 'client_s', '.1f')} | {num(n, 'harness_s', '.1f')} | "
                         f"{_pct(n.get('neighbour_share'))} | {_pct(n.get('steal_share'))} | {verdict} |")
    return lines


def _prefill_note(meta: dict[str, Any]) -> list[str]:
    """The long scenarios' yardstick: the prompt tokens / s the machine's bfloat16 matmul peak allows."""
    bound = meta.get("prefill_bound")
    if not bound:
        return []
    if "error" in bound:
        return [f"- Prefill bound: not measured ({bound['error']})."]
    how = "measured on a 2048³ torch.mm" if bound.get("measured") else "given"
    return [(f"- Long prompts: prompt tok/s is the run's prompt tokens over its wall time (a lower bound on the "
             f"prefill rate: the run decodes too). Next to it, the matmul peak: bfloat16 "
             f"{bound['matmul_peak_gflops']:.0f} GFLOP/s ({how}) at {bound['linear_flops_per_token'] / 1e6:.0f} "
             f"MFLOP of linears a prompt token allows {bound['prompt_tok_s_at_peak']:.0f} prompt tok/s. The chat "
             "scenario runs with tokenline's client only (vLLM's has no multi-turn workload); its prompts count "
             "the history a prefix cache may skip (the share it skipped: cached_tokens_share in the client's JSON).")]


def render_report(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    clients = meta.get("clients") or list(CLIENT_TITLES)
    lines = [
        "# tokenline vs peers" + (f": {meta['model']}" if meta.get("model") else ""),
        "",
        f"{meta['when']} on {meta['host']} ({meta['cpus']} CPUs; load average before: {meta.get('loadavg', '?')}). "
        "One server at a time, each driven by every client in turn; random prompts with a fresh seed per "
        "run, `ignore_eos`, temperature 0. A run is rejected (marked "
        f"{REJECTED}, and rerun up to {meta.get('retry', 0)} time(s)) when other processes took more than "
        f"{meta.get('max_neighbour_cpu', 0):g} % of the machine's CPU during it."
        + (" **Quick/smoke settings: fewer prompts, not a measurement.**" if meta.get("smoke") else ""),
    ]
    for name, result in results.items():
        if result.get("error"):
            lines += ["", f"**{name}: {result['error']}**"]
    for client in clients:
        lines += ["", f"## Client: {CLIENT_TITLES.get(client, client)}", "", *client_table(results, client)]
    lines += ["", "## Every run", "", *runs_table(results), "",
              "## Notes", "",
              (f"- {REJECTED}: no attempt of that run was accepted; the figure is the last rejected attempt's. "
               "A ratio with a rejected side is marked too."),
              ("- Neighbours: machine busy time from /proc/stat (steal included) minus the CPU of the server's "
               "process tree, the client's (its rusage once reaped) and this harness's own, over the run's wall "
               "time (client start to exit, its start-up included), as a share of wall × CPUs."),
              ("- Peak RSS: the sum of VmRSS over the server's process tree, sampled every 0.2 s from /proc over "
               "start-up and load (pages shared between its processes count once per process). Cold start: "
               "launch until `GET /health` answers 200."),
              *_prefill_note(meta),
              "- Models: " + "; ".join(f"{name}: {result.get('model') or '?'}" for name, result in results.items()) + ".",
              "- Command lines, environments and every client's own JSON: results.json and the files beside it.",
              ""]
    return "\n".join(lines)

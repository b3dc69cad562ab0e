"""A fleet plan's charts as one self-contained HTML page of inline SVG (no plotting library: the
venv has none): latency against load with the SLO lines and the chosen point, and cost per million
tokens against load beside the hosted price."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from tokenline.sim.fleet_plan import FleetPlan

WIDTH, HEIGHT, PAD = 560, 300, 56
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


@dataclass
class Chart:
    title: str
    x_label: str
    y_label: str
    series: list[tuple[str, list[tuple[float, float]]]] = field(default_factory=list)
    lines: list[tuple[str, float]] = field(default_factory=list)  # horizontal: label, y
    marker: tuple[str, float, float] | None = None

    def svg(self) -> str:
        xs = [x for _, pts in self.series for x, _ in pts] or [0.0, 1.0]
        ys = [y for _, pts in self.series for _, y in pts] + [y for _, y in self.lines] or [0.0, 1.0]
        x0, x1 = 0.0, max(xs) * 1.05 or 1.0
        y0, y1 = 0.0, max(ys) * 1.1 or 1.0

        def px(x: float) -> float:
            return PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)

        def py(y: float) -> float:
            return HEIGHT - PAD + (y - y0) / (y0 - y1) * (HEIGHT - 2 * PAD)

        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
               f'font-family="sans-serif" font-size="11">',
               f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(self.title)}</text>',
               f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#333"/>',
               f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#333"/>',
               f'<text x="{WIDTH / 2}" y="{HEIGHT - 14}" text-anchor="middle">{html.escape(self.x_label)}</text>',
               f'<text x="14" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 14 {HEIGHT / 2})">'
               f'{html.escape(self.y_label)}</text>']
        for i in range(5):
            xv, yv = x0 + (x1 - x0) * i / 4, y0 + (y1 - y0) * i / 4
            out.append(f'<text x="{px(xv):.1f}" y="{HEIGHT - PAD + 14}" text-anchor="middle">{xv:.3g}</text>')
            out.append(f'<text x="{PAD - 4}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
        for k, (label, y) in enumerate(self.lines):
            out.append(f'<line x1="{PAD}" y1="{py(y):.1f}" x2="{WIDTH - PAD}" y2="{py(y):.1f}" stroke="#888" '
                       f'stroke-dasharray="5,4"/><text x="{WIDTH - PAD}" y="{py(y) - 3:.1f}" text-anchor="end" '
                       f'fill="#555">{html.escape(label)}</text>')
        for k, (label, pts) in enumerate(self.series):
            colour = COLOURS[k % len(COLOURS)]
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(pts))
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
            out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in pts)
            out.append(f'<text x="{PAD + 8}" y="{PAD + 14 * k:.0f}" fill="{colour}">{html.escape(label)}</text>')
        if self.marker:
            label, x, y = self.marker
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="6" fill="none" stroke="#000" stroke-width="2"/>'
                       f'<text x="{px(x) + 8:.1f}" y="{py(y) + 16:.1f}">{html.escape(label)}</text>')
        out.append("</svg>")
        return "\n".join(out)


def plan_charts(plan: FleetPlan) -> list[Chart]:
    c, slo = plan.chosen, plan.slo
    curve = sorted(c.curve, key=lambda p: p.rps)
    at = min(curve, key=lambda p: abs(p.rps - c.capacity_rps))
    tpot = Chart("TPOT against load, one replica", "requests/s per replica", "ms",
                 [("TPOT p50", [(p.rps, p.tpot_p50_ms) for p in curve]),
                  ("TPOT p99", [(p.rps, p.tpot_p99_ms) for p in curve])],
                 [(f"SLO p50 {slo.tpot_p50_ms:g} ms", slo.tpot_p50_ms), (f"SLO p99 {slo.tpot_p99_ms:g} ms",
                                                                        slo.tpot_p99_ms)],
                 ("chosen capacity", at.rps, at.tpot_p99_ms))
    ttft = Chart("TTFT against load, one replica", "requests/s per replica", "ms",
                 [("TTFT p50", [(p.rps, p.ttft_p50_ms) for p in curve]),
                  ("TTFT p99", [(p.rps, p.ttft_p99_ms) for p in curve])],
                 [(f"SLO p99 {slo.ttft_p99_ms:g} ms", slo.ttft_p99_ms)], ("chosen capacity", at.rps, at.ttft_p99_ms))
    per_second = c.tp * plan.price_per_hour / 3600

    def cost(p, share: float, tokens: float) -> float:
        return per_second * share / max(tokens / 1e6, 1e-12)

    money = Chart("Cost per million tokens against load", "requests/s per replica", "US$ per M tokens",
                  [("output", [(p.rps, cost(p, 1 - p.prefill_share, p.output_tok_s)) for p in curve]),
                   ("input", [(p.rps, cost(p, p.prefill_share, p.input_tok_s)) for p in curve])],
                  [(f"hosted output ${plan.hosted_price[1]:.2f}", plan.hosted_price[1]),
                   (f"hosted input ${plan.hosted_price[0]:.2f}", plan.hosted_price[0])],
                  ("chosen", at.rps, cost(at, 1 - at.prefill_share, at.output_tok_s)))
    return [tpot, ttft, money]


def write_plan_html(plan: FleetPlan, path: str) -> None:
    charts = "\n".join(f"<div>{chart.svg()}</div>" for chart in plan_charts(plan))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>tokenline plan: {html.escape(plan.model)} on "
            f"{html.escape(plan.accelerator)}</title></head><body style='font-family:sans-serif'>"
            f"<h1>{html.escape(plan.model)} on {html.escape(plan.accelerator)}</h1>"
            f"<pre>{html.escape(plan.format())}</pre>{charts}</body></html>\n")
    with open(path, "w") as f:
        f.write(page)

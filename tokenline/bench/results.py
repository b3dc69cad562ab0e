"""What one benchmark request produced and the statistics over many, and ``bench serve``'s report of
them: shared by ``bench serve``, its multi-turn workload, ``bench roofline`` and the simulator, which
reports in the same shape."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    """What one request produced; times are seconds from ``time.perf_counter()``."""

    prompt_len: int  # the server's usage.prompt_tokens when reported, else the client's count
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float | None = None  # None: no chunk carried output
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    usage_reported: bool = False
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    text: str = ""  # the answer, collected only when asked (multiturn feeds it back)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:  # e.g. every request failed: report null rather than a made-up zero
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": 1000 * sum(values) / len(values),
        "p50": 1000 * percentile(values, 50),
        "p90": 1000 * percentile(values, 90),
        "p99": 1000 * percentile(values, 99),
    }


@dataclass
class BenchServeReport:
    # settings
    base_url: str
    endpoint: str
    model: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    seed: int
    shared_prefix_len: int
    input_len_exact: bool
    # results
    completed: int
    failed: int
    errors: dict[str, int]  # error message -> count
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    max_in_flight: int  # the most requests this client had in flight at once
    usage_reported: int  # completed requests whose token count came from the server's usage
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    # the workload (the multiturn settings are None for random)
    workload: str = "random"
    num_groups: int | None = None
    num_conversations: int | None = None
    turns: int | None = None
    system_prompt_len: int | None = None
    # Prefix cache over the run, server side: /metrics counter increases (None: not read, the
    # note says why); fleet-wide = sum of hits / sum of queries; one entry per replica.
    prefix_cache_hit_rate: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_replicas: list[dict[str, Any]] = field(default_factory=list)
    prefix_cache_note: str = ""
    # Client side: cached / prompt tokens of the completed requests whose usage reported cached tokens.
    cached_prompt_tokens: int = 0
    cached_tokens_share: float | None = None
    cached_tokens_share_by_turn: list[float | None] = field(default_factory=list)  # multiturn: turn 1, 2, …

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        total = self.total_input_tokens + self.total_output_tokens
        return total / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict: settings, counts, throughputs, and ``<metric>_ms`` statistics."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key.endswith("_ms"):
                name = key.removesuffix("_ms")
                for stat, v in value.items():
                    out[f"{stat}_{name}_ms"] = v
            else:
                out[key] = value
        out["request_throughput"] = self.request_throughput
        out["output_throughput"] = self.output_throughput
        out["total_token_throughput"] = self.total_token_throughput
        return out

    def format_table(self) -> str:
        def num(v: float | None, fmt: str = ".2f") -> str:
            return "-" if v is None else format(v, fmt)

        width = 30

        def pct(v: float | None) -> str:
            return "-" if v is None else f"{100 * v:.1f}%"

        input_note = "" if self.input_len_exact else " (approximate: chat text)"
        rows: list[tuple[str, str] | str] = [
            "settings",
            ("base url", self.base_url),
            ("endpoint", f"{ENDPOINTS[self.endpoint]}"),
            ("model", self.model),
            ("concurrency", str(self.concurrency)),
            ("workload", self.workload),
        ]
        if self.workload == "multiturn":
            rows += [
                ("groups", str(self.num_groups)),
                ("conversations", str(self.num_conversations)),
                ("turns", str(self.turns)),
                ("requests", str(self.num_prompts)),
                ("system prompt len", f"{self.system_prompt_len}{input_note}"),
                ("user message len", f"{self.input_len}{input_note}"),
            ]
        else:
            rows += [
                ("prompts", str(self.num_prompts)),
                ("input len", f"{self.input_len}{input_note}"),
                ("shared prefix len", str(self.shared_prefix_len)),
            ]
        rows += [
            ("output len", str(self.output_len)),
            ("seed", str(self.seed)),
            "results",
            ("completed", str(self.completed)),
            ("failed", str(self.failed)),
            ("duration (s)", num(self.duration_s)),
            ("total input tokens", str(self.total_input_tokens)),
            ("total output tokens", str(self.total_output_tokens)),
            ("max in flight", str(self.max_in_flight)),
            ("request throughput (req/s)", num(self.request_throughput)),
            ("output throughput (tok/s)", num(self.output_throughput)),
            ("total throughput (tok/s)", num(self.total_token_throughput)),
        ]
        for title, stats in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("ITL", self.itl_ms)):
            rows.append(f"{title} (ms)")
            rows.extend((stat, num(stats[stat])) for stat in ("mean", "p50", "p90", "p99"))
        rows.append("E2E latency (ms)")
        rows.extend((stat, num(self.e2e_ms[stat])) for stat in ("mean", "p50", "p99"))
        rows.append("prefix cache")
        hits = "-" if self.prefix_cache_queries is None else \
            f"{pct(self.prefix_cache_hit_rate)} of {self.prefix_cache_queries:.0f} tokens"
        rows.append(("hit rate (/metrics)", hits))
        if len(self.prefix_cache_replicas) > 1:
            for r in self.prefix_cache_replicas:
                where = r["engine"] or r["url"].removesuffix("/metrics")
                rows.append((f"  {where}"[:width - 1], f"{pct(r['hit_rate'])} of {r['queries']:.0f} tokens"))
        rows.append(("cached share (usage)", pct(self.cached_tokens_share)))
        for turn, share in enumerate(self.cached_tokens_share_by_turn, 1):
            rows.append((f"  turn {turn}", pct(share)))
        if self.prefix_cache_note:
            rows.append(f"note: no /metrics hit rate: {self.prefix_cache_note}")
        if self.usage_reported < self.completed:
            rows.append(f"note: {self.completed - self.usage_reported} request(s) sent no usage; "
                        "their output tokens are counted as content chunks")
        if self.errors:
            rows.append("errors")
            rows.extend((str(count), msg[:120]) for msg, count in self.errors.items())

        lines = []
        for row in rows:
            if isinstance(row, str):
                lines.append(f"{'-- ' + row + ' ':-<{width + 20}}" if not row.startswith("note") else row)
            else:
                lines.append(f"{row[0]:<{width}}{row[1]}")
        return "\n".join(lines)


def cached_share(results: Sequence[RequestResult]) -> tuple[int, float | None]:
    """Cached prompt tokens, and their share of the prompt tokens, over the requests that said."""
    said = [r for r in results if r.cached_tokens is not None]
    prompt = sum(r.prompt_len for r in said)
    cached = sum(r.cached_tokens or 0 for r in said)
    return cached, (cached / prompt if prompt > 0 else None)

"""What one benchmark request produced and the statistics over many: shared by ``bench serve``, its
multi-turn workload, ``bench roofline`` and the simulator's report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


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

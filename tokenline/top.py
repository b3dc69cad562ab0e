"""``tokenline top``: a live terminal view of any server that exposes vLLM's metric names.

It reads only Prometheus' text format over HTTP and only vLLM's series (plus the older names vLLM
used before v1), so the same view works against tokenline and against vLLM. Rates and latency
quantiles cover the last interval: counter deltas between two scrapes, and Prometheus'
``histogram_quantile`` over the bucket deltas. A series the server does not export shows "–".
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from rich.table import Table

# Each figure's series, newest vLLM name first: the first one the server exports is used.
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total",)
PREFIX_HITS = ("vllm:prefix_cache_hits_total",)
PREFIX_HIT_RATE = ("vllm:gpu_prefix_cache_hit_rate",)  # vLLM v0 exported the rate itself
FINISHED = "vllm:request_success_total"
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
E2E = ("vllm:e2e_request_latency_seconds",)

NO_VALUE = "–"


class TopError(Exception):
    """The metrics could not be read; the message says why and what to do."""


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (``+Inf`` included), as Prometheus exposes them."""

    buckets: dict[float, float] = field(default_factory=dict)


@dataclass
class Scrape:
    """One model's raw series from one scrape: {sample name: value}, finish reasons, histograms."""

    values: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    gauge_series: dict[str, int] = field(default_factory=dict)  # series summed into a gauge (for means)


@dataclass
class Quantiles:
    p50: float | None
    p99: float | None


@dataclass
class ModelView:
    """What ``top`` shows for one model (None: the server does not export it, or no data yet)."""

    model: str
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None  # 0..1
    prompt_tokens_total: float | None
    generation_tokens_total: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    ttft_s: Quantiles
    itl_s: Quantiles
    e2e_s: Quantiles
    finished_total: dict[str, float]
    finished_in_interval: dict[str, float]
    prefix_cache_hit_rate: float | None  # 0..1, over the interval


@dataclass
class Snapshot:
    url: str
    time: float  # unix seconds of the latest scrape
    interval_s: float | None  # seconds between the two scrapes compared (None: only one so far)
    models: list[ModelView]


def parse_metrics(text: str) -> dict[str, Scrape]:
    """The vLLM series of a Prometheus text exposition, by ``model_name`` (``""`` when unlabelled).

    Series of one model that differ in other labels (vLLM v1's ``engine``) are summed."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise TopError(f"not Prometheus text format: {exc}") from exc
    models: dict[str, Scrape] = defaultdict(Scrape)
    histogram_names = {*TTFT, *ITL, *E2E}
    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if not name.startswith("vllm:") or math.isnan(value):
                continue
            scrape = models[labels.get("model_name", "")]
            base = name.removesuffix("_bucket")
            if name.endswith("_bucket") and base in histogram_names and "le" in labels:
                buckets = scrape.histograms.setdefault(base, Histogram()).buckets
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + value
            elif name == FINISHED and "finished_reason" in labels:
                reason = labels["finished_reason"]
                scrape.finished[reason] = scrape.finished.get(reason, 0.0) + value
            elif "le" not in labels and "quantile" not in labels:
                scrape.values[name] = scrape.values.get(name, 0.0) + value
                if family.type == "gauge":
                    scrape.gauge_series[name] = scrape.gauge_series.get(name, 0) + 1
    # Only models with a series top shows: an info gauge without model_name (vLLM's
    # cache_config_info) is no model.
    shown = {*RUNNING, *WAITING, *KV_USAGE, *PROMPT_TOKENS, *GENERATION_TOKENS, *PREFIX_QUERIES, *PREFIX_HIT_RATE}
    return {m: s for m, s in models.items() if s.finished or s.histograms or shown & s.values.keys()}


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: the q-quantile of cumulative ``buckets`` {upper bound:
    count}, interpolated linearly inside the bucket it falls in. None without a ``+Inf`` bucket or
    observations. Falling in the ``+Inf`` bucket gives the highest finite bound, as Prometheus does."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    # Counts must not fall as the bound rises; a scrape racing an observation can break that.
    counts, highest = [], 0.0
    for bound in bounds:
        highest = max(highest, buckets[bound])
        counts.append(highest)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, count in enumerate(counts) if count >= rank)
    if i == len(bounds) - 1:
        return bounds[-2] if len(bounds) > 1 else None
    upper = bounds[i]
    lower, below = (bounds[i - 1], counts[i - 1]) if i > 0 else (0.0, 0.0)
    if i == 0 and upper <= 0:
        return upper
    in_bucket = counts[i] - below
    return upper if in_bucket <= 0 else lower + (upper - lower) * (rank - below) / in_bucket


def counter_delta(before: float | None, now: float | None) -> float | None:
    """A counter's increase; a counter that fell was reset (a restarted server), so it counts from 0."""
    if now is None:
        return None
    if before is None:
        return None
    return now - before if now >= before else now


def bucket_delta(before: Histogram | None, now: Histogram) -> dict[float, float]:
    """The observations between two scrapes, per bucket (all of ``now`` after a reset)."""
    if before is None:
        return {}
    delta = {le: count - before.buckets.get(le, 0.0) for le, count in now.buckets.items()}
    return dict(now.buckets) if any(v < 0 for v in delta.values()) else delta


def _first(scrape: Scrape, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in scrape.values), None)


def _value(scrape: Scrape | None, names: tuple[str, ...], mean: bool = False) -> float | None:
    if scrape is None or (name := _first(scrape, names)) is None:
        return None
    value = scrape.values[name]
    # A fraction (KV usage) summed over engines would pass 1: it is their mean.
    return value / max(1, scrape.gauge_series.get(name, 1)) if mean else value


def _quantiles(before: Scrape | None, now: Scrape, names: tuple[str, ...]) -> Quantiles:
    name = next((n for n in names if n in now.histograms), None)
    if name is None or before is None:
        return Quantiles(None, None)
    window = bucket_delta(before.histograms.get(name), now.histograms[name])
    return Quantiles(histogram_quantile(0.5, window), histogram_quantile(0.99, window))


def _rate(before: Scrape | None, now: Scrape, names: tuple[str, ...], seconds: float | None) -> float | None:
    delta = counter_delta(_value(before, names), _value(now, names))
    return None if delta is None or not seconds else delta / seconds


def model_view(model: str, before: Scrape | None, now: Scrape, seconds: float | None) -> ModelView:
    """One model's figures: gauges and totals from ``now``, rates and quantiles since ``before``."""
    finished_in_interval = {}
    if before is not None:
        finished_in_interval = {
            reason: counter_delta(before.finished.get(reason, 0.0), count) or 0.0
            for reason, count in now.finished.items()
        }
    hit_rate = None
    queries = counter_delta(_value(before, PREFIX_QUERIES), _value(now, PREFIX_QUERIES))
    hits = counter_delta(_value(before, PREFIX_HITS), _value(now, PREFIX_HITS))
    if queries and hits is not None:
        hit_rate = hits / queries
    elif _first(now, PREFIX_HIT_RATE):
        hit_rate = _value(now, PREFIX_HIT_RATE, mean=True)
        hit_rate = hit_rate if hit_rate is not None and hit_rate >= 0 else None  # v0: -1 when off
    return ModelView(
        model=model,
        running=_value(now, RUNNING),
        waiting=_value(now, WAITING),
        kv_cache_usage=_value(now, KV_USAGE, mean=True),
        prompt_tokens_total=_value(now, PROMPT_TOKENS),
        generation_tokens_total=_value(now, GENERATION_TOKENS),
        prompt_tokens_per_s=_rate(before, now, PROMPT_TOKENS, seconds),
        generation_tokens_per_s=_rate(before, now, GENERATION_TOKENS, seconds),
        ttft_s=_quantiles(before, now, TTFT),
        itl_s=_quantiles(before, now, ITL),
        e2e_s=_quantiles(before, now, E2E),
        finished_total=dict(now.finished),
        finished_in_interval=finished_in_interval,
        prefix_cache_hit_rate=hit_rate,
    )


def snapshot(url: str, before: dict[str, Scrape] | None, now: dict[str, Scrape], seconds: float | None,
             at: float) -> Snapshot:
    """Every model of ``now`` (by name, ignoring case), compared with the scrape ``seconds`` earlier."""
    views = [model_view(m, None if before is None else before.get(m, Scrape()), now[m], seconds)
             for m in sorted(now, key=str.lower)]
    return Snapshot(url=url, time=at, interval_s=seconds if before is not None else None, models=views)


def metrics_url(url: str) -> str:
    """``/metrics`` of a server given by its base URL (``/v1`` tolerated) or by the full path."""
    url = url.rstrip("/")
    if url.endswith("/metrics"):
        return url
    return url.removesuffix("/v1") + "/metrics"


def fetch_metrics(client: httpx.Client, url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise TopError(f"cannot reach {url}: {exc}") from exc
    return metrics_text(url, response)


def metrics_text(url: str, response: httpx.Response, key_flag: str = "--api-key") -> str:
    """The body of a ``/metrics`` answer, or ``TopError`` saying why not (a refused key names the
    flag that passes one, ``key_flag``)."""
    if response.status_code in (401, 403):
        raise TopError(f"{url} answered {response.status_code}: pass a key allowed to read /metrics with "
                       f"{key_flag} (tokenline's default: an admin key)")
    if response.status_code != 200:
        raise TopError(f"{url} answered {response.status_code}: {response.text[:200]}")
    return response.text


# --- rendering --------------------------------------------------------------------------------------

def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return NO_VALUE if value is None else fmt.format(value)


def _seconds(value: float | None) -> str:
    if value is None:
        return NO_VALUE
    return f"{value * 1000:.1f}ms" if value < 0.1 else f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _pair(q: Quantiles) -> str:
    return f"{_seconds(q.p50)} / {_seconds(q.p99)}"


def _finished(view: ModelView) -> str:
    if not view.finished_total:
        return NO_VALUE
    parts = []
    for reason, total in sorted(view.finished_total.items()):
        new = view.finished_in_interval.get(reason)
        if total:  # a reason that never happened is noise (vLLM declares every one at zero)
            parts.append(f"{reason} {total:.0f}" + (f" (+{new:.0f})" if new else ""))
    return ", ".join(parts) or "0"


def render_table(snap: Snapshot) -> Table:
    from rich.table import Table  # imported where it renders: parsing needs no rich

    window = f"last {snap.interval_s:.1f}s" if snap.interval_s else "rates after the next scrape"
    title = f"tokenline top · {snap.url} · {time.strftime('%H:%M:%S', time.localtime(snap.time))} · {window}"
    table = Table(title=title, title_justify="left")
    for header in ("model", "running", "waiting", "KV cache", "prompt tok/s", "gen tok/s", "TTFT p50/p99",
                   "ITL p50/p99", "E2E p50/p99", "prefix hits", "finished"):
        table.add_column(header, justify="left" if header in ("model", "finished") else "right",
                         no_wrap=header != "finished")
    for view in snap.models:
        table.add_row(
            view.model or NO_VALUE, _num(view.running), _num(view.waiting),
            _num(None if view.kv_cache_usage is None else view.kv_cache_usage * 100, "{:.1f}%"),
            _num(view.prompt_tokens_per_s, "{:.1f}"), _num(view.generation_tokens_per_s, "{:.1f}"),
            _pair(view.ttft_s), _pair(view.itl_s), _pair(view.e2e_s),
            _num(None if view.prefix_cache_hit_rate is None else view.prefix_cache_hit_rate * 100, "{:.1f}%"),
            _finished(view),
        )
    if not snap.models:
        table.caption = "no vllm:* series on this endpoint"
    return table


# --- the command ------------------------------------------------------------------------------------

def _scrape(client: httpx.Client, url: str, api_key: str | None) -> tuple[dict[str, Scrape], float, float]:
    text = fetch_metrics(client, url, api_key)
    return parse_metrics(text), time.monotonic(), time.time()


def run_once(url: str, api_key: str | None, interval: float, as_json: bool) -> int:
    """Two scrapes ``interval`` apart, one snapshot printed."""
    with httpx.Client(timeout=10) as client:
        before, t0, _ = _scrape(client, url, api_key)
        time.sleep(interval)
        now, t1, at = _scrape(client, url, api_key)
    snap = snapshot(url, before, now, t1 - t0, at)
    if as_json:
        print(json.dumps(asdict(snap), indent=2))
    else:
        from rich.console import Console

        Console().print(render_table(snap))
    return 0


def run_live(url: str, api_key: str | None, interval: float) -> int:
    """Refresh the table every ``interval`` seconds until Ctrl-C; an unreachable server is shown, not fatal."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    before: dict[str, Scrape] | None = None
    t0 = 0.0
    with httpx.Client(timeout=min(10.0, max(1.0, interval))) as client, Live(
        Text(f"scraping {url} ..."), auto_refresh=False
    ) as live:
        try:
            while True:
                try:
                    now, t1, at = _scrape(client, url, api_key)
                except TopError as exc:
                    live.update(Text(f"{time.strftime('%H:%M:%S')} {exc}", style="red"), refresh=True)
                    before = None  # the next good scrape starts a fresh interval
                else:
                    snap = snapshot(url, before, now, t1 - t0 if before is not None else None, at)
                    hint = Text("Ctrl-C to quit", style="dim")
                    live.update(Group(render_table(snap), hint), refresh=True)
                    before, t0 = now, t1
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0


def top_command(url: str, api_key: str | None, interval: float, once: bool, as_json: bool) -> int:
    target = metrics_url(url)
    try:
        if once or as_json:
            return run_once(target, api_key, interval, as_json)
        return run_live(target, api_key, interval)
    except TopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

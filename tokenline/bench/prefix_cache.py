"""The prefix-cache hit rate over a benchmark run, from the servers' Prometheus ``/metrics``.

vLLM's counters ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` count
prompt tokens looked up and found. The rate over a run is the ratio of their increases between a
scrape before and one after. A fleet's rate is the sum of its replicas' hits over the sum of their
queries (not the mean of their rates: a replica that saw more tokens weighs more). Series of one
URL that carry vLLM's ``engine`` label are kept apart, as replicas behind one API process. A
tokenline fleet behind one API process (``serve --data-parallel-size``) sums its engines into
vLLM's series but exports per-upstream ones: prompt tokens finished on each upstream and the cached
tokens it reported; those give the per-replica figures there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenline.top import TopError, counter_delta, metrics_text, metrics_url

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
UPSTREAM_PROMPT = "tokenline:router_prompt_tokens_total"
UPSTREAM_HITS = "tokenline:router_prefix_hit_tokens_total"  # source="reported": what the upstream said


class ScrapeError(Exception):
    """A ``/metrics`` could not be read; the message says why."""


@dataclass
class PrefixCounters:
    """One replica's counters at one scrape: ``url`` is its /metrics, ``engine`` the label ("" if none)."""

    url: str
    engine: str
    queries: float
    hits: float


@dataclass
class PrefixScrape:
    """Every URL's vLLM counters (``totals``) and, where a fleet exports them, per-upstream ones."""

    totals: list[PrefixCounters]
    upstreams: list[PrefixCounters]


@dataclass
class ReplicaHitRate:
    url: str
    engine: str
    queries: float  # prompt tokens looked up during the run
    hits: float
    hit_rate: float | None  # None: no lookups during the run


def parse_prefix_counters(url: str, text: str) -> list[PrefixCounters]:
    """The prefix-cache counters of one exposition, per ``engine`` label, summed over models."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ScrapeError(f"{url}: not Prometheus text format: {exc}") from exc
    sums: dict[str, dict[str, float]] = defaultdict(lambda: {QUERIES: 0.0, HITS: 0.0})
    seen = False
    for family in families:
        for sample in family.samples:
            if sample.name in (QUERIES, HITS) and not math.isnan(sample.value):
                sums[sample.labels.get("engine", "")][sample.name] += sample.value
                seen = True
    if not seen:
        raise ScrapeError(f"{url} exports no {QUERIES}")
    return [PrefixCounters(url, engine, v[QUERIES], v[HITS]) for engine, v in sorted(sums.items())]


def parse_upstream_counters(url: str, text: str) -> list[PrefixCounters]:
    """A tokenline fleet's per-upstream prompt tokens and reported cached tokens ([] if none)."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: {UPSTREAM_PROMPT: 0.0, UPSTREAM_HITS: 0.0})
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            upstream = sample.labels.get("upstream")
            if upstream is None or math.isnan(sample.value):
                continue
            if sample.name == UPSTREAM_PROMPT or (sample.name == UPSTREAM_HITS
                                                  and sample.labels.get("source") == "reported"):
                sums[upstream][sample.name] += sample.value
    return [PrefixCounters(url, name, v[UPSTREAM_PROMPT], v[UPSTREAM_HITS]) for name, v in sorted(sums.items())]


async def scrape_prefix_counters(client: httpx.AsyncClient, urls: list[str],
                                 api_key: str | None) -> PrefixScrape:
    """Every replica's counters now; ``urls`` are base URLs or full ``/metrics`` URLs."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    scrape = PrefixScrape([], [])
    for base in urls:
        url = metrics_url(base)
        try:
            response = await client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            raise ScrapeError(f"cannot reach {url}: {exc}") from exc
        try:
            text = metrics_text(url, response, key_flag="--metrics-api-key")
        except TopError as exc:
            raise ScrapeError(str(exc)) from exc
        scrape.totals += parse_prefix_counters(url, text)
        scrape.upstreams += parse_upstream_counters(url, text)
    return scrape


def _deltas(before: list[PrefixCounters], after: list[PrefixCounters]) -> list[ReplicaHitRate]:
    start = {(c.url, c.engine): c for c in before}
    rates = []
    for c in after:
        b = start.get((c.url, c.engine))  # missing before (a new engine label): counts from zero
        queries = counter_delta(b.queries if b else 0.0, c.queries) or 0.0
        hits = counter_delta(b.hits if b else 0.0, c.hits) or 0.0
        rates.append(ReplicaHitRate(c.url, c.engine, queries, hits, hits / queries if queries > 0 else None))
    return rates


def hit_rates(before: PrefixScrape, after: PrefixScrape) -> tuple[float | None, float, float, list[ReplicaHitRate]]:
    """Over the increases from ``before`` to ``after``: the fleet-wide rate (sum of hits / sum of
    queries of vLLM's counters), those sums, and each replica's figures — the vLLM counters' when
    they name more than one replica, else a fleet's per-upstream ones when it exports them."""
    totals = _deltas(before.totals, after.totals)
    total_q = sum(r.queries for r in totals)
    total_h = sum(r.hits for r in totals)
    replicas = totals
    if len(totals) == 1 and after.upstreams:
        replicas = _deltas(before.upstreams, after.upstreams)
    return (total_h / total_q if total_q > 0 else None), total_q, total_h, replicas

"""``/metrics`` in Prometheus text format, with the series names vLLM dashboards already scrape.

Engine gauges (running, waiting, KV usage) and engine counters (preemptions, prefix-cache queries
and hits, speculative draft tokens proposed and accepted) are read from the engine's latest stats
at scrape time. Per-request histograms are observed in the API process once per engine request:
TTFT when its first token arrives, the rest when it finishes — so TTFT's count is the number of
requests that produced a first token and e2e latency's count equals the sum of
``vllm:request_success_total``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenline.engine.messages import EngineStats, RequestTimings

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class StatsSource(Protocol):
    """Where the engine series come from: any ``EngineClient`` (one engine, or a router's sum)."""

    @property
    def stats(self) -> EngineStats: ...

    @property
    def num_inflight(self) -> int: ...

    def backlog_tokens(self) -> int: ...


@runtime_checkable
class FleetSource(Protocol):
    """A fleet of replicas (``tokenline.router.fleet.FleetClient``), for per-upstream series.
    ``counters``: per member, an object with ``requests``, ``errors``, ``retries``, ``ejections``,
    ``predicted_hit_tokens``, ``reported_hit_tokens`` and ``prompt_tokens``; ``decisions``: routed
    requests per (member, reason)."""

    counters: Mapping[str, Any]
    decisions: Mapping[tuple[str, str], int]

    def member_healthy(self, name: str) -> bool: ...


class _FleetCollector(Collector):
    def __init__(self, fleet: FleetSource) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        counters = self.fleet.counters

        def per_upstream(family: CounterMetricFamily | GaugeMetricFamily, field: str) -> Metric:
            for name, counts in counters.items():
                family.add_metric([name], getattr(counts, field))
            return family

        up = ["upstream"]
        yield per_upstream(CounterMetricFamily("tokenline:router_requests", "Requests routed to each upstream "
                                               "(retries counted where they landed).", labels=up), "requests")
        yield per_upstream(CounterMetricFamily("tokenline:router_errors", "Requests that failed on each upstream.",
                                               labels=up), "errors")
        yield per_upstream(CounterMetricFamily("tokenline:router_retries", "Requests moved away from each upstream "
                                               "before their first token.", labels=up), "retries")
        yield per_upstream(CounterMetricFamily("tokenline:router_ejections", "Times each upstream was ejected "
                                               "after a failure.", labels=up), "ejections")
        yield per_upstream(CounterMetricFamily("tokenline:router_prompt_tokens", "Prompt tokens of requests "
                                               "finished on each upstream.", labels=up), "prompt_tokens")
        hits = CounterMetricFamily("tokenline:router_prefix_hit_tokens", "Prompt tokens cached on each upstream: "
                                   "predicted by the routing policy, or reported by the upstream.",
                                   labels=["upstream", "source"])
        for name, counts in counters.items():
            hits.add_metric([name, "predicted"], counts.predicted_hit_tokens)
            hits.add_metric([name, "reported"], counts.reported_hit_tokens)
        yield hits
        decisions = CounterMetricFamily("tokenline:router_decisions", "Routing decisions by upstream and reason.",
                                        labels=["upstream", "reason"])
        for (name, reason), count in sorted(self.fleet.decisions.items()):
            decisions.add_metric([name, reason], count)
        yield decisions
        healthy = GaugeMetricFamily("tokenline:router_upstream_healthy", "1 while an upstream may take new "
                                    "requests (ready, passing health checks, not ejected).", labels=up)
        for name in counters:
            healthy.add_metric([name], 1.0 if self.fleet.member_healthy(name) else 0.0)
        yield healthy


class _EngineCollector(Collector):
    def __init__(self, source: StatsSource, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.source.stats
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%).", stats.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Preemptions so far.", stats.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield counter("vllm:spec_decode_num_drafts", "Speculative steps (one request verifying its drafts).",
                      stats.spec_decode_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_decode_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      stats.spec_decode_num_accepted_tokens)
        if stats.num_state_checkpoints:  # hybrid models' prefix caching
            yield counter("tokenline_state_checkpoint_hits", "Admissions that restored a recurrent-state checkpoint.",
                          stats.state_checkpoint_hits)
            yield counter("tokenline_state_checkpoints_saved", "Recurrent-state checkpoints written.",
                          stats.state_checkpoints_saved)
            yield gauge("tokenline_state_checkpoints_used", "Recurrent-state checkpoint slots holding a state.",
                        stats.num_state_checkpoints_used)
            yield gauge("tokenline_state_checkpoints", "Recurrent-state checkpoint slots.", stats.num_state_checkpoints)
            yield counter("tokenline_prefix_cache_kv_matched", "Prompt tokens the KV blocks alone matched "
                          "(before the cut to the deepest state checkpoint).", stats.prefix_cache_kv_matched)
        yield counter("tokenline_grammar_compiles", "Structured-output grammars compiled.", stats.grammar_compile_count)
        yield counter("tokenline_grammar_compile_seconds", "Seconds spent compiling grammars.",
                      stats.grammar_compile_seconds_sum)
        yield counter("tokenline_grammar_cache_hits", "Constrained requests whose grammar was already compiled.",
                      stats.grammar_cache_hits)
        yield gauge("tokenline_grammar_cache_bytes", "Estimated memory of the compiled grammars kept for reuse.",
                    stats.grammar_cache_bytes)
        yield gauge("tokenline_grammar_cache_entries", "Compiled (or compiling) grammars kept for reuse.",
                    stats.grammar_cache_entries)
        yield counter("tokenline_grammar_cache_evictions", "Compiled grammars evicted to keep the cache within "
                      "--grammar-cache-bytes.", stats.grammar_cache_evictions)
        yield GaugeMetricFamily("tokenline_kv_cache_free_blocks", "Free KV cache blocks.", stats.num_free_kv_blocks)
        yield GaugeMetricFamily("tokenline_kv_cache_blocks", "KV cache blocks in the pool.", stats.num_kv_blocks)
        yield GaugeMetricFamily(
            "tokenline_inflight_requests", "Engine requests the API process waits on.", self.source.num_inflight
        )
        yield GaugeMetricFamily(
            "tokenline_stream_backlog_tokens",
            "Generated tokens not yet taken by their (slow) clients.",
            self.source.backlog_tokens(),
        )


class ServerMetrics:
    """The server's own registry (no global state): engine series plus per-request observations."""

    def __init__(self, source: StatsSource, model_name: str, tenant_labels: bool = False) -> None:
        self.model_name = model_name
        # Tenant names (customers) and their spend are business data: on /metrics only when the
        # operator asks (--metrics-tenant-labels); otherwise those series are summed over tenants.
        self.tenant_labels = tenant_labels
        t = ["tenant"] if tenant_labels else []
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(source, model_name))
        if isinstance(source, FleetSource):  # serve --data-parallel-size, tokenline router
            self.registry.register(_FleetCollector(source))
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", [*m, "finished_reason"], registry=r
        )
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output updates.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Decode time per output token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling.", m,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "First scheduling to first token.", m,
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "First token to last token.", m,
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m,
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                                   m, buckets=_TOKEN_BUCKETS, registry=r)
        # The edge's own series.
        self.rejected = Counter("tokenline_rejected_requests", "Requests refused at the edge, by reason.",
                                ["reason"], registry=r)
        self.open_connections = Gauge("tokenline_open_connections",
                                      "Open HTTP connections: pending (no request let in yet) or admitted.",
                                      ["pool"], registry=r)
        self.rate_limited = Counter("tokenline_rate_limited_requests", "Requests refused by a rate limit.",
                                    [*t, "limit"], registry=r)
        self.spend = Counter("tokenline_spend_usd", "Spend recorded in the usage ledger (USD).",
                             [*t, "model_name"], registry=r)
        self.content_filter = Counter(
            "tokenline:content_filter_decisions", "Safety-filter verdicts: one per request per filter and stage.",
            ["filter", "stage", "verdict"], registry=r,
        )

        # Every per-request series exists at zero from start-up, as vLLM's do, so a dashboard of a
        # fresh server shows 0 rather than "no data".
        for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                       self.queue, self.prefill, self.decode, self.request_prompt_tokens,
                       self.request_generation_tokens):
            family.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        # Observed once per streamed token: the labelled children are looked up once, not per call.
        self._ttft_child = self.ttft.labels(model_name)
        self._itl_child = self.itl.labels(model_name)

    def declare_filter(self, name: str, stages: Iterable[str], verdicts: Iterable[str]) -> None:
        """A configured filter's series exist at zero before its first verdict."""
        for stage in stages:
            for verdict in verdicts:
                self.content_filter.labels(name, stage, verdict)

    def count_rate_limited(self, tenant: str, limit: str) -> None:
        self.rate_limited.labels(*self._tenant(tenant), limit).inc()

    def add_spend(self, tenant: str, model: str, usd: float) -> None:
        self.spend.labels(*self._tenant(tenant), model).inc(usd)

    def _tenant(self, tenant: str) -> list[str]:
        return [tenant] if self.tenant_labels else []

    def first_token(self, ttft_s: float) -> None:
        self._ttft_child.observe(ttft_s)

    def inter_token(self, seconds: float) -> None:
        self._itl_child.observe(seconds)

    def finished(
        self, prompt_tokens: int, completion_tokens: int, finish_reason: str, timings: RequestTimings | None,
        arrival: float, finished_at: float,
    ) -> None:
        """One engine request ended (for any reason): count it once in every per-request series."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        self.request_success.labels(name, finish_reason).inc()
        self.e2e.labels(name).observe(max(0.0, finished_at - arrival))
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        self.request_generation_tokens.labels(name).observe(completion_tokens)
        if timings is None or timings.first_scheduled is None:
            return
        self.queue.labels(name).observe(max(0.0, timings.first_scheduled - arrival))
        if timings.first_token is None:
            return
        self.prefill.labels(name).observe(max(0.0, timings.first_token - timings.first_scheduled))
        last = timings.last_token or timings.first_token
        self.decode.labels(name).observe(max(0.0, last - timings.first_token))
        if completion_tokens > 1:
            self.tpot.labels(name).observe(max(0.0, last - timings.first_token) / (completion_tokens - 1))

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

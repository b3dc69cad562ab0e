"""``/metrics`` in Prometheus text format, with the series names vLLM dashboards already scrape.

Gauges are read from the engine's latest stats at scrape time by a custom collector, so nothing
is double-booked between the engine process and the API process.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenline.engine.async_client import AsyncEngineClient


class EngineCollector(Collector):
    def __init__(self, client: AsyncEngineClient) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", stats.kv_cache_usage)
        yield CounterMetricFamily("vllm:num_preemptions", "Preemptions so far.", stats.num_preemptions)
        yield GaugeMetricFamily("tokenline_kv_cache_free_blocks", "Free KV cache blocks.", stats.num_free_kv_blocks)
        yield GaugeMetricFamily("tokenline_kv_cache_blocks", "KV cache blocks in the pool.", stats.num_kv_blocks)
        yield GaugeMetricFamily("tokenline_inflight_requests", "Engine requests the API process waits on.", self.client.num_inflight)
        yield GaugeMetricFamily(
            "tokenline_stream_backlog_tokens",
            "Generated tokens not yet taken by their (slow) clients.",
            self.client.backlog_tokens(),
        )


def make_registry(client: AsyncEngineClient) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(client))
    return registry


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

"""An upstream's load from its ``/metrics``, read by vLLM's series names (tokenline exposes the same).

Engines and models of one server are summed (KV usage: their mean), so a vLLM server with several
engines looks like one replica. Older vLLM names (``gpu_cache_usage_perc``) are read too.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tokenline.engine.messages import EngineStats


@dataclass
class UpstreamLoad:
    """What one scrape said: the load snapshot, and the KV layout where the server tells it."""

    stats: EngineStats
    block_size: int | None = None
    num_kv_blocks: int | None = None


def _sum(samples: dict[str, list[float]], *names: str) -> float | None:
    for name in names:
        if name in samples:
            return sum(samples[name])
    return None


def parse_upstream_metrics(text: str) -> UpstreamLoad:
    """Parse a Prometheus exposition; series that are missing read as zero."""
    samples: dict[str, list[float]] = {}
    block_size: int | None = None
    num_blocks: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.value)
            if sample.name == "vllm:cache_config_info":  # an info gauge: the layout is in its labels
                if sample.labels.get("block_size", "").isdigit():
                    block_size = int(sample.labels["block_size"])
                if sample.labels.get("num_gpu_blocks", "").isdigit():
                    num_blocks = int(sample.labels["num_gpu_blocks"])
    usage_names = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    usage = next((samples[n] for n in usage_names if n in samples), [])
    tokenline_blocks = _sum(samples, "tokenline_kv_cache_blocks")
    free_blocks = _sum(samples, "tokenline_kv_cache_free_blocks")
    stats = EngineStats(
        num_running=int(_sum(samples, "vllm:num_requests_running") or 0),
        num_waiting=int(_sum(samples, "vllm:num_requests_waiting") or 0),
        kv_cache_usage=sum(usage) / len(usage) if usage else 0.0,
        num_preemptions=int(_sum(samples, "vllm:num_preemptions_total", "vllm:num_preemptions") or 0),
        prefix_cache_queries=int(_sum(samples, "vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries") or 0),
        prefix_cache_hits=int(_sum(samples, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits") or 0),
        num_kv_blocks=int(tokenline_blocks if tokenline_blocks is not None else num_blocks or 0),
        num_free_kv_blocks=int(free_blocks or 0),
    )
    if stats.num_kv_blocks and free_blocks is None:  # vLLM tells usage, not free blocks
        stats.num_free_kv_blocks = round(stats.num_kv_blocks * (1.0 - stats.kv_cache_usage))
    return UpstreamLoad(stats, block_size, num_blocks or (int(tokenline_blocks) if tokenline_blocks else None))

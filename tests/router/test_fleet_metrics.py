"""Per-replica series on /metrics for any fleet (``serve --data-parallel-size``, ``tokenline router``):
the gateway's collector reads a ``FleetClient``'s counters, decisions and member health."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenline.engine.messages import EngineReady, EngineStats
from tokenline.gateway.metrics import FleetSource, ServerMetrics
from tokenline.router.fleet import FleetClient
from tokenline.router.policies import make_policy
from tokenline.router.remote_client import RemoteEngineClient, parse_upstream


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.response().body.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_fleet_series_follow_counters_decisions_and_health() -> None:
    members = {name: RemoteEngineClient(parse_upstream(f"http://{name}")) for name in ("a:1", "b:2")}
    fleet = FleetClient(members, make_policy("prefix"))
    assert isinstance(fleet, FleetSource)
    metrics = ServerMetrics(fleet, "m")
    fleet.counters["a:1"].requests = 5
    fleet.counters["a:1"].errors = 1
    fleet.counters["a:1"].predicted_hit_tokens = 64
    fleet.counters["a:1"].reported_hit_tokens = 48
    fleet.decisions[("a:1", "prefix")] = 3
    fleet.decisions[("b:2", "retry")] = 1
    members["a:1"].healthy = True  # as after a passing health check, with the model's facts
    members["a:1"].info = members["b:2"].info = None
    samples = _samples(metrics)
    assert samples[("tokenline:router_requests_total", (("upstream", "a:1"),))] == 5
    assert samples[("tokenline:router_requests_total", (("upstream", "b:2"),))] == 0
    assert samples[("tokenline:router_errors_total", (("upstream", "a:1"),))] == 1
    assert samples[("tokenline:router_prefix_hit_tokens_total", (("source", "predicted"), ("upstream", "a:1")))] == 64
    assert samples[("tokenline:router_prefix_hit_tokens_total", (("source", "reported"), ("upstream", "a:1")))] == 48
    assert samples[("tokenline:router_decisions_total", (("reason", "prefix"), ("upstream", "a:1")))] == 3
    assert samples[("tokenline:router_decisions_total", (("reason", "retry"), ("upstream", "b:2")))] == 1
    # Not ready yet (no model facts): not healthy, whatever its last check said.
    assert samples[("tokenline:router_upstream_healthy", (("upstream", "a:1"),))] == 0
    members["a:1"].info = EngineReady(2048, 100, 16, "remote")
    assert _samples(metrics)[("tokenline:router_upstream_healthy", (("upstream", "a:1"),))] == 1
    fleet.eject("a:1", 60)
    samples = _samples(metrics)
    assert samples[("tokenline:router_upstream_healthy", (("upstream", "a:1"),))] == 0
    assert samples[("tokenline:router_ejections_total", (("upstream", "a:1"),))] == 1


def test_a_single_engine_has_no_fleet_series() -> None:
    class One:  # a StatsSource without counters or decisions, as one engine's client
        stats = EngineStats()
        num_inflight = 0

        def backlog_tokens(self) -> int:
            return 0

    one = One()
    text = ServerMetrics(one, "m").response().body.decode()
    assert "vllm:num_requests_running" in text and "router_" not in text

"""bench/fleet_compare.py: its table and ratios, its arguments, and the single-replica path for real
(a server started, the multiturn workload run against it, the server's process group gone after)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.bench.scripts import load_bench_script
from tokenline.bench.results import BenchServeReport


@pytest.fixture(scope="module")
def fleet_compare() -> ModuleType:
    return load_bench_script("fleet_compare.py", "fleet_compare")


def report(hit_rate: float | None, ttft_p50: float, replicas: list[tuple[float, float]] = (), failed: int = 0,
           ) -> BenchServeReport:
    stats = {"mean": 1.0, "p50": ttft_p50, "p90": 1.0, "p99": 1.0}
    queries = sum(q for q, _ in replicas) or None
    return BenchServeReport(
        base_url="u", endpoint="chat", model="m", concurrency=4, num_prompts=24, input_len=64, output_len=16,
        seed=0, shared_prefix_len=0, input_len_exact=False, completed=24 - failed, failed=failed, errors={},
        duration_s=10.0, total_input_tokens=1000, total_output_tokens=200, max_in_flight=4, usage_reported=24,
        ttft_ms=stats, tpot_ms={**stats, "p50": 50.0}, itl_ms=stats, e2e_ms=stats, workload="multiturn",
        prefix_cache_hit_rate=hit_rate, prefix_cache_queries=queries,
        prefix_cache_replicas=[{"url": "u", "engine": f"engine-{i}", "queries": q, "hits": h,
                                "hit_rate": h / q} for i, (q, h) in enumerate(replicas)],
    )


def test_rows_carry_the_ratios_the_targets_need(fleet_compare: ModuleType) -> None:
    reports = {
        fleet_compare.REFERENCE: report(0.8, 100.0),
        "round_robin": report(0.5, 200.0, [(600, 300), (400, 200)]),
        "prefix": report(0.72, 150.0, [(500, 400), (500, 320)], failed=1),
    }
    decisions = {"prefix": {"prefix": 20, "smallest_tree": 4}}
    rows = {row["policy"]: row for row in fleet_compare.summarize(reports, decisions)}
    prefix = rows["prefix"]
    assert prefix["hit_rate_vs_single"] == pytest.approx(0.9)
    assert prefix["hit_rate_vs_round_robin"] == pytest.approx(1.44)
    assert prefix["ttft_p50_vs_round_robin"] == pytest.approx(0.75)
    assert prefix["replica_hit_rates"] == [0.8, 0.64] and prefix["replica_query_share"] == [0.5, 0.5]
    assert prefix["errors"] == 1
    assert rows["round_robin"]["replica_query_share"] == [0.6, 0.4]
    assert rows[fleet_compare.REFERENCE]["replica_hit_rates"] == []
    table = fleet_compare.markdown_table(list(rows.values()))
    lines = table.splitlines()
    assert lines[0].startswith("| policy | fleet hit rate |") and len(lines) == 5
    assert "| prefix | 72.0% | 80.0% (50.0%) / 64.0% (50.0%) | 150 | 50.0 |" in table
    assert lines[-1].endswith("| 0.90× | 1.44× | 0.75× | prefix 20, smallest_tree 4 |")
    assert lines[-2].endswith("| 0.62× | 1.00× | 1.00× | – |")


def test_without_round_robin_or_a_hit_rate_the_ratios_are_dashes(fleet_compare: ModuleType) -> None:
    rows = fleet_compare.summarize({"prefix": report(None, 150.0)})
    assert rows[0]["hit_rate_vs_round_robin"] is None and rows[0]["hit_rate_vs_single"] is None
    assert fleet_compare.markdown_table(rows).splitlines()[-1].endswith("| – | – | – | – |")


def test_arguments(fleet_compare: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = fleet_compare.parse_args(["--mode", "router", "--policies", "prefix, kv_events"])
    assert args.mode == "router" and args.policies == ["prefix", "kv_events"]
    with pytest.raises(SystemExit):
        fleet_compare.parse_args(["--policies", "random"])
    assert "unknown random" in capsys.readouterr().err
    args = fleet_compare.parse_args(["--num-kv-blocks", "300"])
    argv = fleet_compare.serve_args(args, Path("logs"), "single")
    assert argv[argv.index("--num-kv-blocks") + 1] == "300"
    assert "--num-kv-blocks" not in fleet_compare.serve_args(fleet_compare.parse_args([]), Path("logs"), "single")
    with pytest.raises(SystemExit):
        fleet_compare.parse_args(["--num-kv-blocks", "0"])
    assert "--num-kv-blocks must be >= 1" in capsys.readouterr().err


def test_single_replica_path_for_real(fleet_compare: ModuleType, tmp_path: Path, default_model_dir: Path) -> None:
    args = fleet_compare.parse_args(["--num-groups", "1", "--num-conversations", "2", "--turns", "2",
                                     "--system-prompt-len", "32", "--input-len", "8", "--output-len", "3",
                                     "--max-concurrency", "2", "--num-kv-blocks", "64"])
    with fleet_compare.start_single(args, tmp_path) as running:
        assert running.metrics_urls == [] and len(running.servers) == 1
        result = fleet_compare.run_workload(args, running.url, running.metrics_urls)
        assert fleet_compare.routing_decisions(running.url) == {}  # one engine: no router series
        assert "tokenline_kv_cache_blocks 64.0" in httpx.get(f"{running.url}/metrics").text  # --num-kv-blocks
    (server,) = running.servers
    assert (result.completed, result.failed) == (4, 0)
    assert result.workload == "multiturn" and result.turns == 2
    assert result.prefix_cache_hit_rate is not None and result.prefix_cache_hit_rate > 0
    (row,) = fleet_compare.summarize({fleet_compare.REFERENCE: result})
    assert row["hit_rate_vs_single"] == pytest.approx(1.0)
    # Stopped by pid: the server exited (SIGTERM: cleanly) and nothing of its process group is left.
    assert server.process.returncode == 0, server.log.read_text()[-2000:]
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)

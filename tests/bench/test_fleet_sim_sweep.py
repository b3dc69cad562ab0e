"""bench/fleet_sim_sweep.py: ratios taken within a seed, and a small real sweep that reproduces
``tokenline simulate --replicas 2`` run by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench.scripts import load_bench_script
from tokenline.cli import main as cli_main
from tokenline.sim.profile import Profile
from tokenline.sim.step_model import StepModel


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return load_bench_script("fleet_sim_sweep.py", "fleet_sim_sweep")


def test_ratios_are_taken_within_a_seed(sweep: ModuleType) -> None:
    shape = sweep.Shape.parse("300/16/1024")
    s = str(shape)
    Run = sweep.Run
    runs = [
        Run(s, "round_robin", 0, 0.2, 1000.0, 10.0), Run(s, "prefix", 0, 0.5, 300.0, 12.0),
        Run(s, "round_robin", 1, 0.4, 800.0, 10.0), Run(s, "prefix", 1, 0.6, 400.0, 15.0),
        Run(s, "round_robin", 2, 0.3, 500.0, 10.0), Run(s, "prefix", 2, 0.9, 400.0, 30.0),
        Run(s, "single", 0, 0.1, 2000.0, 5.0),  # seed 0 only
    ]
    rows = {r["policy"]: r for r in sweep.summarize(runs, [shape], ["round_robin", "prefix", "single"])}
    prefix = rows["prefix"]
    # 2.5, 1.5, 3.0 by seed: the median and min of those, not a ratio of medians (0.6 / 0.3 = 2.0).
    assert prefix["vs_rr_median"] == pytest.approx(2.5) and prefix["vs_rr_min"] == pytest.approx(1.5)
    assert prefix["vs_single_min"] == pytest.approx(5.0)
    assert prefix["ttft_vs_rr_median"] == pytest.approx(0.5) and prefix["ttft_vs_rr_max"] == pytest.approx(0.8)
    assert prefix["tok_s_vs_rr_min"] == pytest.approx(1.2)
    assert "vs_rr_median" not in rows["round_robin"] and "vs_rr_median" not in rows["single"]
    table = sweep.markdown(list(rows.values()))
    assert "| 300/16/1024 | prefix | 50.0 60.0 90.0 | 2.50× | 1.50× | 5.00× | 0.50× (0.80×) | 1.20× |" in table


def test_arguments(sweep: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = sweep.parse_args(["--profile", "p.json", "--policies", "prefix", "--seeds", "1-3", "--no-single"])
    assert args.policies == ["round_robin", "prefix"] and args.seeds == [1, 2, 3]
    for bad, message in ((["--shapes", "300/16"], "a shape is BLOCKS/GROUPS/SYSTEM_LEN"),
                         (["--policies", "fastest"], "unknown fastest")):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--profile", "p.json", *bad])
        assert message in capsys.readouterr().err


def test_a_small_sweep_reproduces_simulate(sweep: ModuleType, tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    Profile(step_model=StepModel(a=0.02, b=0.001, c=0.002, d=0.0), model="SmolLM2-135M-Instruct", dtype="float32",
            machine={"note": "written by the test"}, vocab_size=49152, max_model_len=8192,
            kv_bytes_per_token=46080).write(profile)
    workload = ["--num-conversations", "6", "--turns", "2", "--input-len", "8", "--output-len", "4",
                "--concurrency", "2"]
    out = tmp_path / "sweep.json"
    assert sweep.main(["--profile", str(profile), "--shapes", "40/3/128", "--seeds", "0-1", "--policies", "prefix",
                       "--output-json", str(out), *workload]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["policy"], r["seed"]) for r in runs) == [
        (p, s) for p in ("prefix", "round_robin", "single") for s in (0, 1)]
    by_hand = tmp_path / "simulate.json"
    assert cli_main(["simulate", "--profile", str(profile), "--replicas", "2", "--routing-policy", "prefix",
                     "--workload", "multiturn", "--num-groups", "3", "--system-prompt-len", "128",
                     "--num-kv-blocks", "40", "--seed", "1", "--output-json", str(by_hand), *workload]) == 0
    expected = json.loads(by_hand.read_text())
    (mine,) = [r for r in runs if r["policy"] == "prefix" and r["seed"] == 1]
    assert mine["hit_rate"] == pytest.approx(expected["prefix_cache_hit_rate"]) and mine["hit_rate"] > 0
    assert mine["ttft_p50_ms"] == pytest.approx(expected["p50_ttft_ms"])
    assert mine["output_tok_s"] == pytest.approx(expected["output_throughput"])

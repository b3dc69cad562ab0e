"""``tokenline plan --accelerator``: a traffic forecast to replicas, settings, latency and cost per
million tokens, through the real scheduler on a simulated clock (small sweeps here: seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.cli import main
from tokenline.model.loader import model_class
from tokenline.sim.accelerator import accelerator_cost
from tokenline.sim.fleet_plan import Forecast, PlanError, Slo, build_replica, plan_fleet, users_to_rps
from tokenline.sim.machine import load_machine
from tokenline.sim.sim_target import read_model_config

ROOT = Path(__file__).parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
QWEN = str(ROOT / "tokenline" / "sim" / "configs" / "qwen3.5-27b.json")
LLAMA_8B = str(FIXTURES / "llama-3.1-8b.json")
LLAMA_70B = str(FIXTURES / "llama-3.1-70b.json")
GEMMA = str(FIXTURES / "gemma-3-27b.json")


def small_plan(config: str, machine: str, peak: float, **kwargs: object):
    forecast = Forecast(peak_rps=peak, input_len=512, output_len=64)
    return plan_fleet(read_model_config(config), Path(config).stem, load_machine(machine), forecast, Slo(),
                      num_requests=48, sweep_requests=32, max_num_seqs_options=(64,),
                      **kwargs)  # type: ignore[arg-type]


def test_a_qwen_hybrid_plan_on_h200_prints_replicas_costs_and_writes_its_charts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    html, js = tmp_path / "plan.html", tmp_path / "plan.json"
    assert main(["plan", "--model", QWEN, "--accelerator", "h200", "--peak-rps", "6", "--input-len", "512",
                 "--output-len", "64", "--shared-prefix-fraction", "0.3", "--turns", "2",
                 "--plot", str(html), "--output-json", str(js)]) == 0
    out = capsys.readouterr().out
    for field in ("replicas", "--max-num-seqs", "KV blocks", "at peak", "off-peak", "cost per M tokens",
                  "$0.45 input, $3.20 output"):
        assert field in out
    plan = json.loads(js.read_text())
    chosen = plan["chosen"]
    # Enough replicas for the peak with the headroom asked for (20 %), each within the SLOs.
    assert plan["replicas"] * chosen["capacity_rps"] >= 6 * 1.2 - 1e-9
    assert plan["peak"]["tpot_p99_ms"] <= plan["slo"]["tpot_p99_ms"]
    assert plan["cost_per_m_input"] > 0 and plan["cost_per_m_output"] > plan["cost_per_m_input"]
    assert plan["weights_gb"] > 50 and chosen["max_num_seqs"] == 256
    # 54 GB of bf16 weights fit one H200's 141 GB, but not beside 256 sequences' recurrent states and
    # their 512 prefix-cache checkpoints: the smallest replica is two GPUs.
    assert min(c["tp"] for c in plan["candidates"]) == 2
    page = html.read_text()
    assert page.count("<svg") == 3 and "SLO p99" in page and "hosted output $3.20" in page


def test_a_hybrid_replica_sizes_its_states_and_checkpoints_from_memory() -> None:
    config = read_model_config(QWEN)
    cost = accelerator_cost(config)
    h200 = load_machine("h200")
    assert build_replica(config, cost, h200, 1, 256) is None
    one, two = build_replica(config, cost, h200, 1, 64), build_replica(config, cost, h200, 2, 64)
    assert one is not None and two is not None and one.num_checkpoints == 128 and one.num_state_slots == 64
    assert two.num_kv_blocks > 2 * one.num_kv_blocks  # the second GPU's memory is all cache


def test_more_traffic_needs_more_replicas_and_a_big_model_needs_tensor_parallelism() -> None:
    low, high = small_plan(LLAMA_8B, "h100", 2.0), small_plan(LLAMA_8B, "h100", 40.0)
    assert high.replicas > low.replicas and low.chosen.tp == high.chosen.tp == 1
    big = small_plan(LLAMA_70B, "h100", 2.0)
    assert big.chosen.tp >= 2  # 141 GB of weights on 80 GB GPUs
    assert big.weights_gb / big.chosen.tp < 80 * 0.9
    assert big.candidates and all(c.tp >= 2 for c in big.candidates)


def test_a_model_too_big_for_its_tensor_parallel_group_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="leave no KV block"):
        small_plan(LLAMA_70B, "rtx4090", 1.0, tensor_parallel_size=2)


def test_gemma3_plans_where_its_architecture_is_registered() -> None:
    try:
        model_class("Gemma3ForConditionalGeneration")
    except Exception:  # the Gemma 3 model arrives on its own branch
        pytest.skip("Gemma 3 is not registered on this branch")
    plan = small_plan(GEMMA, "h100", 2.0)
    assert plan.replicas >= 1 and plan.weights_gb > 40


def test_bad_fleet_plans_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    def refused(*argv: str) -> str:
        assert main(["plan", "--model", LLAMA_8B, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tokenline plan: ") and "\n" not in err and "Traceback" not in err
        return err

    assert "--memory GIB" in refused()
    assert "one of --peak-rps or --concurrent-users" in refused("--accelerator", "h100")
    assert "one of --peak-rps" in refused("--accelerator", "h100", "--peak-rps", "1", "--concurrent-users", "5")
    assert "neither a known machine" in refused("--accelerator", "nosuch", "--peak-rps", "1")
    assert "--daily-curve" in refused("--accelerator", "h100", "--peak-rps", "1", "--daily-curve", "1,2")
    assert "--shared-prefix-fraction" in refused("--accelerator", "h100", "--peak-rps", "1",
                                                 "--shared-prefix-fraction", "1.5")


def test_concurrent_users_become_requests_per_second_by_littles_law() -> None:
    # 1,200 users, each waiting 5 s for an answer and thinking 10 s: 80 requests a second.
    assert users_to_rps(1200, 10.0, 5.0) == pytest.approx(80.0)


def test_the_memory_plan_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", LLAMA_8B, "--memory", "80"]) == 0
    assert "sequences of 4096 tokens that fit" in capsys.readouterr().out


def test_a_wider_group_that_cannot_be_cheaper_is_not_swept_and_the_plan_counts_its_steps() -> None:
    plan = small_plan(LLAMA_8B, "h100", 2.0)
    # One H100 holds the 8B model; two of them cannot serve twice the requests of one, so the
    # second degree stops after its saturated run, and says so.
    assert [c.tp for c in plan.candidates] == [1] and plan.chosen.tp == 1
    assert any("not swept" in n and "tensor-parallel 2" in n for n in plan.notes)
    swept = sum(c.steps for c in plan.candidates) + plan.peak.steps + plan.off_peak.steps
    assert plan.peak.steps > 0 and plan.simulated_steps > swept  # the tp 2 saturated run counted too
    assert f"simulated: {plan.simulated_steps:,} engine steps" in plan.format()

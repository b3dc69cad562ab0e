"""`tokenline simulate`'s what-ifs: another model (--model-config), another machine (--machine), the
pool and batch overrides. Step times scale from a profile by the roofline ratio of the default
model's real config and the shipped Qwen3.5-27B-shaped one (counted on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.cli import main
from tokenline.sim.accelerator import AcceleratorStepModel
from tokenline.sim.placeholder_runner import SimClock
from tokenline.sim.profile import Profile
from tokenline.sim.roofline_scaling import model_cost
from tokenline.sim.sim_target import WhatIf, resolve_target
from tokenline.sim.simulate import SimConfig, build_sim_core, run_closed_loop, simulate, workload_prompts
from tokenline.sim.step_model import StepModel

BIG = str(Path(__file__).parents[2] / "tokenline" / "sim" / "configs" / "qwen3.5-27b.json")
# Roughly this dev box's calibration (float32, one thread): 8 GB/s, 47 GFLOP/s.
HERE = {"memory_bandwidth_gbps": 8.0, "matmul_gflops": 47.0}


@pytest.fixture(scope="module")
def profile() -> Profile:
    from tokenline.store.model_store import resolve_model

    config = json.loads((resolve_model(None, progress=False) / "config.json").read_text())
    return Profile(step_model=StepModel(a=0.040, b=0.003, c=0.012, d=7e-6), model="small", dtype="float32",
                   machine=dict(HERE), vocab_size=config["vocab_size"], max_model_len=8192,
                   kv_bytes_per_token=46080, request_overhead_s=0.01, model_config=config)


def run(profile: Profile, **kwargs: object) -> dict:
    config = SimConfig(concurrency=4, num_prompts=8, input_len=64, output_len=8, **kwargs)  # type: ignore[arg-type]
    return simulate(profile, config).to_dict()


def test_the_calibrated_models_own_config_on_this_machine_changes_nothing(profile: Profile, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(profile.model_config))
    same, base = run(profile, model_config=str(path), kv_cache_memory_gib=1.0), run(profile, kv_cache_memory_gib=1.0)
    assert same.pop("model") == tmp_path.name and base.pop("model") == "small"  # named after the config's folder
    assert same == base and base["p50_tpot_ms"] > 0


def test_a_bigger_model_gives_longer_steps_and_fewer_blocks(profile: Profile) -> None:
    small = resolve_target(profile, WhatIf(kv_cache_memory_gib=40), 4, 16)
    big = resolve_target(profile, WhatIf(model_config=BIG, kv_cache_memory_gib=40), 4, 16)
    assert big.kv_bytes_per_token == 2 * 16 * 4 * 256 * 4  # 16 full-attention layers, float32 here
    assert big.num_state_slots == 4 and big.num_kv_blocks < small.num_kv_blocks / 2
    base = run(profile, kv_cache_memory_gib=40)
    bigger = run(profile, model_config=BIG, kv_cache_memory_gib=40)
    # ~200x the weights to read per decode step on the same machine
    assert bigger["p50_tpot_ms"] > 50 * base["p50_tpot_ms"]
    assert bigger["p50_ttft_ms"] > 50 * base["p50_ttft_ms"]


def test_the_h200_profile_gives_shorter_steps_and_a_pool_from_its_memory(profile: Profile) -> None:
    here, h200 = run(profile), run(profile, machine="h200")
    assert h200["p50_tpot_ms"] < here["p50_tpot_ms"] / 5 and h200["p50_ttft_ms"] < here["p50_ttft_ms"]
    big = resolve_target(profile, WhatIf(model_config=BIG, machine="h200"), 64, 16)
    cost = model_cost(big_config(), 2)
    assert big.weight_bytes == cost.weight_bytes == 2 * 26_895_998_464  # bf16 on the h200
    budget = int(141e9 * 0.9) - cost.weight_bytes - 64 * cost.state_bytes_per_sequence
    assert big.num_kv_blocks == budget // (65_536 * 16)
    # A GPU of the table has its own step model, its fixed costs inside it, and its own request overhead.
    assert isinstance(big.step_model, AcceleratorStepModel) and big.step_overhead_s == 0.0
    assert big.request_overhead_s == pytest.approx(0.005)
    big_run = run(profile, model_config=BIG, machine="h200")
    assert big_run["completed"] == 8 and big_run["p50_tpot_ms"] > h200["p50_tpot_ms"]


def big_config():
    from tokenline.sim.sim_target import read_model_config

    return read_model_config(BIG)


def test_max_num_seqs_caps_the_simulated_batch(profile: Profile) -> None:
    config = SimConfig(concurrency=8, num_prompts=16, input_len=32, output_len=6, max_num_seqs=3, machine="h200")
    target = resolve_target(profile, config.what_if, config.max_num_seqs, config.block_size)
    clock = SimClock()
    core = build_sim_core(target, config, clock)
    result = run_closed_loop(core, workload_prompts(config, target.vocab_size), 6, 8, 0.0, clock.wait_until)
    records = core.take_step_records()
    assert max(r.num_seqs for r in records) == 3 and max(r.num_running for r in records) == 3
    assert result.max_in_flight == 8 and all(r.output_tokens == 6 for r in result.results)


def test_num_kv_blocks_overrides_the_memory_arithmetic(profile: Profile) -> None:
    assert resolve_target(profile, WhatIf(machine="h200", num_kv_blocks=77), 8, 16).num_kv_blocks == 77
    assert resolve_target(profile, WhatIf(num_kv_blocks=9), 8, 16).num_kv_blocks == 9
    # 9 blocks of 16 tokens hold two 72-token requests at a time: the rest wait or are preempted
    r = run(profile, num_kv_blocks=9)
    assert r["completed"] == 8


def test_bad_what_ifs_are_one_line_errors(profile: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    profile.write(path)
    base = ["simulate", "--profile", str(path), "--num-prompts", "2", "--input-len", "16", "--output-len", "2"]

    def refused(*extra: str) -> str:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tokenline simulate: ") and "\n" not in err and "Traceback" not in err
        return err

    assert "neither a known machine" in refused("--machine", "nosuch")
    (tmp_path / "m.json").write_text(json.dumps({"memory_bandwidth_gbps": 100}))
    assert "lacks the field 'matmul_tflops'" in refused("--machine", str(tmp_path / "m.json"))
    assert "cannot read" in refused("--model-config", str(tmp_path / "none.json"))
    (tmp_path / "odd.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "num_attention_heads": 2}))
    assert "not supported" in refused("--model-config", str(tmp_path / "odd.json"))
    assert "do not fit in l4's 24 GB" in refused("--model-config", BIG, "--machine", "l4")
    assert "state slots" in refused("--model-config", BIG, "--kv-cache-memory", "1")
    assert "--num-kv-blocks must be >= 1" in refused("--num-kv-blocks", "0")
    assert "--kv-cache-memory must be > 0" in refused("--kv-cache-memory", "-1")

    old = Profile(**{**profile.__dict__, "machine": {}, "model_config": None})
    old.write(path)
    assert "calibrate again" in refused("--machine", "h200")

    profile.write(path)
    assert main([*base, "--machine", "h200", "--model-config", BIG]) == 0
    assert "qwen3.5-27b on h200" in capsys.readouterr().out

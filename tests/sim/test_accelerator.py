"""The accelerator step model: a GPU's step time from the machine table alone (no calibration of
this machine enters it), growing as a step reads and computes more, and split over tensor parallelism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.model.config import ModelConfig
from tokenline.store.model_store import resolve_model
from tokenline.sim.accelerator import AcceleratorStepModel, accelerator_cost
from tokenline.sim.machine import MachineError, builtin_machines, load_machine
from tokenline.sim.profile import Profile
from tokenline.sim.sim_target import WhatIf, read_model_config, resolve_target
from tokenline.sim.simulate import SimConfig, simulate
from tokenline.sim.step_model import StepFeatures, StepModel

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA = str(FIXTURES / "llama-3.1-8b.json")
TABLE = ("h100", "h200", "a100-40gb", "a100-80gb", "l40s", "rtx4090")


def test_the_table_holds_every_gpu_with_its_price_and_fractions() -> None:
    assert set(TABLE) <= set(builtin_machines())
    for name in TABLE:
        m = load_machine(name)
        assert m.is_accelerator and m.memory_gb and m.price_per_hour and m.price_per_hour > 0
        assert 0 < (m.bandwidth_efficiency or 0) <= 1 and m.interconnect_gbps
    assert load_machine("h200").memory_gb > load_machine("h100").memory_gb
    assert load_machine("h200").memory_bandwidth_gbps > load_machine("h100").memory_bandwidth_gbps


def test_a_step_costs_more_as_it_reads_and_computes_more() -> None:
    model = AcceleratorStepModel(accelerator_cost(read_model_config(LLAMA)), load_machine("h100"))
    one = model.predict(StepFeatures(0, 1, 1024))
    assert model.predict(StepFeatures(0, 64, 64 * 1024)) > one  # more KV to read
    assert model.predict(StepFeatures(2048, 0, 2048, 2048 * 2049 // 2)) > 5 * one  # compute bound
    # A decode step of one sequence reads the weights once: ~16 GB at the achieved bandwidth.
    m = load_machine("h100")
    floor = 16.06e9 / (m.memory_bandwidth_gbps * 1e9)
    assert floor < one < 2 * floor
    slower = AcceleratorStepModel(accelerator_cost(read_model_config(LLAMA)), load_machine("a100-40gb"))
    assert slower.predict(StepFeatures(0, 1, 1024)) > one


def test_tensor_parallelism_splits_the_work_and_adds_communication() -> None:
    cost = accelerator_cost(read_model_config(LLAMA))
    f = StepFeatures(0, 32, 32 * 1024)
    tp1 = AcceleratorStepModel(cost, load_machine("h100"), 1)
    tp4 = AcceleratorStepModel(cost, load_machine("h100"), 4)
    assert tp4.parts(f)["comm"] > 0 == tp1.parts(f)["comm"]
    assert tp4.parts(f)["linears"] == pytest.approx(tp1.parts(f)["linears"] / 4)
    assert tp4.predict(f) < tp1.predict(f)
    # Over PCIe (no NVLink) the same split pays more for its all-reduces.
    pcie = AcceleratorStepModel(cost, load_machine("l40s"), 4)
    assert pcie.parts(f)["comm"] > tp4.parts(f)["comm"]


def test_a_layer_pays_for_the_kernels_its_architecture_launches() -> None:
    """The fixed cost a layer adds is the table's Llama layer overhead scaled by the kernels vLLM
    launches for it: q/k norms and Gemma 3's sandwich norms cost more than a Llama layer of the same
    shape; an architecture not counted pays as a Llama layer."""
    raw = json.loads(Path(LLAMA).read_text())
    h100 = load_machine("h100")

    def fixed(architecture: str) -> float:
        config = ModelConfig.from_dict(dict(raw, architectures=[architecture]), FIXTURES)
        return AcceleratorStepModel(accelerator_cost(config), h100).parts(StepFeatures(0, 1, 1024))["fixed"]

    llama, qwen3, gemma = fixed("LlamaForCausalLM"), fixed("Qwen3ForCausalLM"), fixed("Gemma3ForCausalLM")
    per_layer = h100.layer_overhead_us / 1e6
    assert qwen3 - llama == pytest.approx(raw["num_hidden_layers"] * per_layer * 2 / 10)
    assert gemma - llama == pytest.approx(raw["num_hidden_layers"] * per_layer * 4 / 10)
    assert fixed("MistralForCausalLM") == pytest.approx(llama)


def test_a_gpu_prediction_does_not_move_with_this_machines_calibration() -> None:
    config = json.loads((resolve_model(None, progress=False) / "config.json").read_text())

    def profile(scale: float) -> Profile:  # two calibrations of this CPU, one 30 % slower
        return Profile(step_model=StepModel(a=0.04 * scale, b=0.003 * scale, c=0.012 * scale, d=7e-6 * scale),
                       model="small", dtype="float32", vocab_size=config["vocab_size"], max_model_len=8192,
                       machine={"memory_bandwidth_gbps": 8.0 * scale, "matmul_gflops": 47.0 / scale},
                       kv_bytes_per_token=46080, request_overhead_s=0.01 * scale, model_config=config)

    sim = SimConfig(concurrency=4, num_prompts=8, input_len=256, output_len=16, model_config=LLAMA, machine="h100")
    a, b = simulate(profile(1.0), sim).to_dict(), simulate(profile(1.3), sim).to_dict()
    assert a["completed"] == b["completed"] == 8
    assert a["p50_tpot_ms"] == b["p50_tpot_ms"] and a["p50_ttft_ms"] == b["p50_ttft_ms"] and a["p50_tpot_ms"] > 0
    # The CPU itself, scaled from the calibration, does move.
    here = SimConfig(concurrency=4, num_prompts=8, input_len=64, output_len=4)
    slow, fast = simulate(profile(1.0), here).to_dict(), simulate(profile(1.3), here).to_dict()
    assert slow["p50_tpot_ms"] != fast["p50_tpot_ms"]
    target = resolve_target(profile(1.0), WhatIf(model_config=LLAMA, machine="h100"), 128, 16)
    assert isinstance(target.step_model, AcceleratorStepModel)


def test_a_machine_file_with_part_of_the_fractions_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"memory_bandwidth_gbps": 1000, "matmul_tflops": 100, "bandwidth_efficiency": 0.8}))
    with pytest.raises(MachineError, match="must all be given"):
        load_machine(str(path))

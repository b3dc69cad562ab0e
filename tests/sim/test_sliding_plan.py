"""Sliding-window models in the simulator and planner: the simulated KV books get the real engine's
KV cache groups, a pool block holds one group's layers, and the accelerator model reads a sliding
layer's window only. A Gemma-3-27B-shaped config (62 layers, 5:1 sliding, window 1024) against the
same config with every layer global."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.request import Request
from tokenline.model.config import ModelConfig
from tokenline.model.kv_groups import group_windows, kv_block_bytes
from tokenline.model.batch import ScheduledBatch, ScheduledSeq
from tokenline.sampling_params import SamplingParams
from tokenline.sim.accelerator import AcceleratorStepModel, accelerator_cost
from tokenline.sim.fleet_plan import Forecast, Slo, build_replica, plan_fleet
from tokenline.sim.machine import load_machine
from tokenline.sim.step_model import StepFeatures, batch_features, windowed_pair_count

SLIDING = Path(__file__).parents[2] / "docs" / "benchmarks" / "data" / "configs" / "gemma-3-27b-llama-shaped.json"


def configs() -> tuple[ModelConfig, ModelConfig]:
    raw = json.loads(SLIDING.read_text())
    all_global = {**raw, "layer_types": ["full_attention"] * raw["num_hidden_layers"]}
    all_global.pop("sliding_window")
    return ModelConfig.from_dict(raw), ModelConfig.from_dict(all_global)


def test_a_sliding_replica_has_the_engines_kv_groups_and_blocks_of_one_groups_layers() -> None:
    sliding, full = configs()
    h200 = load_machine("h200")
    s = build_replica(sliding, accelerator_cost(sliding), h200, 1, 256)
    g = build_replica(full, accelerator_cost(full), h200, 1, 256)
    assert s is not None and g is not None
    # 10 global and 52 sliding layers: groups of gcd(10, 52) = 2 layers, as the engine's runner builds them.
    assert s.windows == tuple(group_windows(sliding)) == (None,) * 5 + (1024,) * 26
    assert g.windows == (None,)
    per_token = accelerator_cost(sliding).cost.kv_bytes_per_token
    assert per_token == 62 * 2 * 16 * 128 * 2
    assert kv_block_bytes(sliding, per_token, 16) == 2 * 2 * 16 * 128 * 2 * 16  # two layers' K and V
    # The same memory in blocks of 2 layers rather than 62.
    assert s.num_kv_blocks == pytest.approx(31 * g.num_kv_blocks, rel=1e-3)


def test_windowed_features_count_what_a_sliding_layer_sees() -> None:
    for start, n, window in ((0, 5, 3), (2, 7, 4), (10, 3, 4), (0, 2048, 1024), (3000, 1, 1024)):
        brute = sum(min(p + 1, window) for p in range(start, start + n))
        assert windowed_pair_count(start, n, window) == brute
    params = SamplingParams()
    seqs = [ScheduledSeq("d", [1], 5000, [], True, params, prompt_token_ids=[0] * 4000),
            ScheduledSeq("p", [0] * 600, 2000, [], False, params, prompt_token_ids=[0] * 3000)]
    f = batch_features(ScheduledBatch(seqs), window=1024)
    assert (f.decode_seqs, f.prefill_tokens, f.attended_context_tokens) == (1, 600, 5001 + 2600)
    # The decode's window; the chunk's last query sees its window, its first 1024 - 1 keys before it.
    assert f.windowed_context_tokens == 1024 + (1024 + 600 - 1)
    assert f.windowed_attention_pairs == 600 * 1024
    assert batch_features(ScheduledBatch(seqs)).windowed_context_tokens is None


def test_a_long_context_decode_step_reads_less_kv_with_sliding_layers() -> None:
    sliding, full = configs()
    h200 = load_machine("h200")
    step = StepFeatures(0, 64, 64 * 8192, 0, 64 * 1024, 0)
    t_sliding = AcceleratorStepModel(accelerator_cost(sliding), h200).parts(step)["attention"]
    t_global = AcceleratorStepModel(accelerator_cost(full), h200).parts(step)["attention"]
    # 10 of 62 layers read 8192 tokens, the other 52 their 1024: about a quarter of the global read.
    assert t_sliding / t_global == pytest.approx((10 * 8192 + 52 * 1024) / (62 * 8192), rel=0.05)


def decoding_sequences_that_fit(config: ModelConfig, prompt_len: int = 8192) -> int:
    """Sequences of ``prompt_len`` tokens an H200 replica's real KV books hold while they decode."""
    replica = build_replica(config, accelerator_cost(config), load_machine("h200"), 1, 256)
    assert replica is not None
    kv = KVCacheManager(replica.num_kv_blocks, 16, False, group_windows=replica.windows, max_chunk_tokens=prompt_len)
    params = SamplingParams(max_tokens=16)
    for n in range(10_000):
        req = Request(EngineRequest(str(n), [n % 1000] * prompt_len, params), 16, frozenset())
        if not kv.allocate_slots(req, prompt_len):
            return n
        req.num_computed_tokens = prompt_len
        assert kv.allocate_slots(req, 1)  # its first decode step: a sliding group lets the blocks behind go
        req.num_computed_tokens += 1
    raise AssertionError("unbounded")


def test_the_sliding_window_fits_more_sequences_and_serves_more_per_replica() -> None:
    sliding, full = configs()
    s_fit, g_fit = decoding_sequences_that_fit(sliding), decoding_sequences_that_fit(full)
    # Per sequence: 10 layers' 8193 tokens + 52 layers' window blocks, against 62 layers' 8193 tokens.
    assert g_fit == pytest.approx(16, abs=1) and s_fit > 3 * g_fit
    forecast = Forecast(peak_rps=4.0, input_len=8192, output_len=64, input_spread=0.0, output_spread=0.0)
    slo = Slo(ttft_p99_ms=10_000, tpot_p50_ms=100, tpot_p99_ms=200)
    s, g = [plan_fleet(c, name, load_machine("h200"), forecast, slo, num_requests=24, sweep_requests=24,
                       tensor_parallel_size=1) for c, name in ((sliding, "sliding"), (full, "global"))]
    assert s.chosen.saturated_rps > 1.1 * g.chosen.saturated_rps
    assert s.chosen.capacity_rps > g.chosen.capacity_rps and s.cost_per_m_output < g.cost_per_m_output


def test_simulate_what_if_of_a_sliding_model_on_a_gpu_uses_its_kv_groups(tmp_path: Path) -> None:
    from tokenline.store.model_store import resolve_model
    from tokenline.sim.profile import Profile
    from tokenline.sim.sim_target import WhatIf, resolve_target
    from tokenline.sim.simulate import SimConfig, simulate
    from tokenline.sim.step_model import StepModel

    config = json.loads((resolve_model(None, progress=False) / "config.json").read_text())
    profile = Profile(step_model=StepModel(a=0.040, b=0.003, c=0.012, d=7e-6), model="small", dtype="float32",
                      machine={"memory_bandwidth_gbps": 8.0, "matmul_gflops": 47.0},
                      vocab_size=config["vocab_size"], max_model_len=8192, kv_bytes_per_token=46080,
                      model_config=config)
    global_path = tmp_path / "all-global.json"
    raw = json.loads(SLIDING.read_text())
    raw.pop("sliding_window")
    global_path.write_text(json.dumps({**raw, "layer_types": ["full_attention"] * 62}))
    s = resolve_target(profile, WhatIf(model_config=str(SLIDING), machine="h200"), 64, 16)
    g = resolve_target(profile, WhatIf(model_config=str(global_path), machine="h200"), 64, 16)
    assert s.windows == tuple(group_windows(configs()[0])) and s.sliding_window == 1024 and g.windows == (None,)
    assert s.num_kv_blocks == pytest.approx(31 * g.num_kv_blocks, rel=1e-3)
    run = simulate(profile, SimConfig(concurrency=4, num_prompts=4, input_len=2048, output_len=4,
                                      model_config=str(SLIDING), machine="h200")).to_dict()
    assert run["completed"] == 4 and run["p50_tpot_ms"] > 0

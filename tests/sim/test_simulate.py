"""`tokenline simulate`: the real scheduler and KV cache on a simulated clock (no model, no torch work)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.cli import main
from tokenline.sim.placeholder_runner import SimClock
from tokenline.sim.profile import Profile
from tokenline.sim.simulate import (
    SimConfig, api_contention_factor, build_sim_core, run_closed_loop, sim_target, simulate, workload_prompts,
)
from tokenline.sim.step_model import StepFeatures, StepModel

STEP = StepModel(a=0.010, b=0.001, c=0.002, d=1e-6)


def profile(step_model: StepModel = STEP, overhead_s: float = 0.0) -> Profile:
    return Profile(step_model=step_model, model="m", dtype="float32", machine={}, vocab_size=1000,
                   max_model_len=4096, kv_bytes_per_token=46080, request_overhead_s=overhead_s)


def test_the_same_workload_gives_the_same_report_and_every_token() -> None:
    config = SimConfig(concurrency=3, num_prompts=7, input_len=40, output_len=9, max_num_seqs=2)
    first = simulate(profile(), config).to_dict()
    assert first == simulate(profile(), config).to_dict()
    assert first["completed"] == 7 and first["failed"] == 0
    assert first["total_output_tokens"] == 7 * 9 and first["total_input_tokens"] == 7 * 40
    assert first["max_in_flight"] == 3
    assert first["output_throughput"] == pytest.approx(63 / first["duration_s"])


def test_a_lone_request_decodes_at_the_predicted_step_time() -> None:
    # b = d = 0: every decode step of one sequence takes a + c, the first token the prefill's a + b·I
    flat = StepModel(a=0.005, b=0.0, c=0.003, d=0.0)
    r = simulate(profile(flat, overhead_s=0.02), SimConfig(num_prompts=2, input_len=16, output_len=5))
    assert r.itl_ms["p50"] == pytest.approx(8.0) and r.tpot_ms["mean"] == pytest.approx(8.0)
    assert r.ttft_ms["p50"] == pytest.approx(20.0 + 5.0)  # overhead, then one prefill step (a)
    assert r.e2e_ms["p50"] == pytest.approx(20.0 + 5.0 + 4 * 8.0)
    assert r.duration_s == pytest.approx(2 * 0.057)


def test_batches_never_exceed_max_num_seqs_and_queued_requests_wait_for_their_first_token() -> None:
    p = profile()
    clock = SimClock()
    config = SimConfig(concurrency=6, num_prompts=12, input_len=32, output_len=8, max_num_seqs=2)
    core = build_sim_core(sim_target(p, config), config, clock)
    run = run_closed_loop(core, workload_prompts(config, p.vocab_size), 8, 6, 0.0, clock.wait_until)
    records = core.take_step_records()
    assert max(r.num_seqs for r in records) == 2
    assert max(r.num_waiting for r in records) >= 3  # the client keeps 6 in flight; 4 queue
    assert run.max_in_flight == 6 and all(r.output_tokens == 8 for r in run.results)

    ttft = {c: simulate(p, SimConfig(concurrency=c, num_prompts=12, input_len=32, output_len=8, max_num_seqs=2))
            .ttft_ms["p50"] for c in (1, 2, 6)}
    assert ttft[2] < 2 * ttft[1]  # within max_num_seqs: batched (two prefills in one step), not queued
    assert ttft[6] > 3 * ttft[2]  # beyond it: a request waits for a running one to finish


def test_a_small_kv_pool_preempts_but_still_completes_everything() -> None:
    # 46080 B/token * 16 = 720 KiB a block: 0.01 GiB is 14 blocks (224 tokens) for 4 × 72-token requests
    config = SimConfig(concurrency=4, num_prompts=8, input_len=48, output_len=24, kv_cache_memory_gib=0.01)
    r = simulate(profile(), config)
    assert r.completed == 8 and r.total_output_tokens == 8 * 24


def test_cli_writes_bench_serve_fields_and_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    profile().write(path)
    out = tmp_path / "sim.json"
    argv = ["simulate", "--profile", str(path), "--concurrency", "2", "--num-prompts", "4", "--input-len", "16",
            "--output-len", "4", "--output-json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    for key in ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p90_itl_ms", "p50_e2e_ms",
                "total_output_tokens", "duration_s", "request_throughput"):
        assert key in data, key
    assert data["total_output_tokens"] == 16 and data["base_url"] == "simulated"
    assert "output throughput (tok/s)" in capsys.readouterr().out

    (tmp_path / "bad.json").write_text("{not json")
    assert main(["simulate", "--profile", str(tmp_path / "bad.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(path), "--input-len", "5000"]) == 2
    assert "maximum context length is 4096 tokens" in capsys.readouterr().err  # the one context message
    assert main(["simulate", "--profile", str(path), "--concurrency", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_calibrate_refuses_a_missing_model_before_loading_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "calibrate", "--model", str(tmp_path / "none"), "--output", str(tmp_path / "p.json")]) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "p.json").exists()


def test_requests_sent_together_reach_the_engine_one_overhead_apart() -> None:
    # A real server's API process takes requests in turn (here 10 ms each): the first starts a prefill
    # step alone (74 ms), the others land during it and are prefilled together in the next, as the
    # step records of a real c=32 run show.
    p = profile(overhead_s=0.01)
    clock = SimClock()
    config = SimConfig(concurrency=4, num_prompts=4, input_len=64, output_len=3)
    core = build_sim_core(sim_target(p, config), config, clock)
    run = run_closed_loop(core, workload_prompts(config, p.vocab_size), 3, 4, 0.01, clock.wait_until)
    records = core.take_step_records()
    assert records[0].start == pytest.approx(0.01) and (records[0].num_seqs, records[0].num_prefill_tokens) == (1, 64)
    assert (records[1].num_prefill_tokens, records[1].num_decode_tokens) == (3 * 64, 1)
    ttft = sorted(r.ttft for r in run.results)
    assert ttft[0] == pytest.approx(0.01 + STEP.predict(StepFeatures(64, 0, 64)))
    assert ttft[1] > 2 * ttft[0]  # the other three waited for the lone step


def test_a_step_beside_the_api_process_runs_slower_on_a_cpu_it_shares() -> None:
    """On the calibrated CPU, with the engine's threads on every core, the API process handing over a
    wave of requests takes a core from the step beside it: the lone first step runs at half speed
    while the others are handed over, so all of them land before it ends and wait for the next."""
    p = profile(overhead_s=0.01)
    config = SimConfig(concurrency=16, num_prompts=16, input_len=64, output_len=3)
    lone = STEP.predict(StepFeatures(64, 0, 64))
    runs = {}
    for factor in (1.0, 2.0):
        clock = SimClock()
        core = build_sim_core(sim_target(p, config), config, clock)
        run = run_closed_loop(core, workload_prompts(config, p.vocab_size), 3, 16, 0.01, clock.wait_until, factor)
        runs[factor] = (core.take_step_records(), sorted(r.ttft for r in run.results))
    (plain, plain_ttft), (shared, shared_ttft) = runs[1.0], runs[2.0]
    # The API is busy for 15 more hand-overs (150 ms) after the first: the 74 ms step doubles.
    assert shared[1].start - shared[0].start == pytest.approx(2 * lone)
    assert plain[1].start - plain[0].start == pytest.approx(lone)
    # Nearly all made the second step, as in the real server's step records (15: 960 prefill tokens at once).
    assert shared[1].num_prefill_tokens >= 14 * 64 > plain[1].num_prefill_tokens
    assert shared_ttft[0] == pytest.approx(0.01 + 2 * lone)
    cpu = Profile(**{**vars(p), "machine": {"device": "cpu", "cpu_count": 2, "torch_threads": 2}})
    assert api_contention_factor(cpu, config) == 2.0
    assert api_contention_factor(cpu, SimConfig(machine="h100")) == 1.0  # another machine: no shared core
    spare = Profile(**{**vars(p), "machine": {"device": "cpu", "cpu_count": 8, "torch_threads": 4}})
    assert api_contention_factor(spare, config) == 1.0 and api_contention_factor(p, config) == 1.0


def test_simulation_defaults_follow_the_server() -> None:
    """A simulation with default options must schedule as a default `tokenline serve` does (step
    budget, sequences a step), or it predicts another server."""
    from tokenline.cli import build_parser
    from tokenline.engine.config import EngineConfig

    serve = build_parser().parse_args(["serve"])
    sim = build_parser().parse_args(["simulate", "--profile", "profile.json"])
    engine = EngineConfig()
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        assert getattr(SimConfig(), name) == getattr(engine, name) == getattr(serve, name) == getattr(sim, name), name

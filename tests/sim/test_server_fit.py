"""What a server adds to the offline step model: the fit on server step records, and the simulator
applying it. (The real server run itself is `bench calibrate`'s; test_calibrate_real runs it.)"""

from __future__ import annotations

import random

import pytest

from tokenline.sim.profile import Profile
from tokenline.sim.server_fit import ServerRun, busy_steps, fit_overheads, fit_scale_and_overhead, record_features
from tokenline.sim.simulate import SimConfig, simulate
from tokenline.sim.step_model import StepFeatures, StepModel

MODEL = StepModel(a=0.040, b=0.003, c=0.012, d=7e-6)


def record(step: int, start: float, duration: float, prefill: int = 0, decode: int = 1, context: int = 100,
           drafts: int = 0, pairs: int = 0) -> dict:
    return {"step": step, "start": start, "duration": duration, "num_prefill_tokens": prefill,
            "num_decode_tokens": decode, "num_draft_tokens": drafts, "num_context_tokens": context,
            "num_prefill_attention_pairs": pairs}


def test_busy_steps_keep_back_to_back_steps_only() -> None:
    records = [record(0, 0.0, 0.10, prefill=64, decode=0), record(1, 0.102, 0.05), record(2, 0.155, 0.05),
               record(3, 1.0, 0.05),  # the engine sat idle before this one: step 2's wall is not a step's
               record(5, 1.06, 0.05)]  # a step missing from the stream: no wall for step 3
    steps = busy_steps(records)
    assert [round(w, 3) for _, w in steps] == [0.102, 0.053]
    assert steps[0][0] == StepFeatures(64, 0, 100)
    assert record_features(record(0, 0, 0, prefill=3, decode=5, drafts=2)) == StepFeatures(5, 3, 100)
    assert record_features(record(0, 0, 0, prefill=64, decode=0, pairs=8256)) == StepFeatures(64, 0, 100, 8256)
    # a record from a server before the pairs were recorded
    old = record(0, 0, 0, prefill=64, decode=0)
    del old["num_prefill_attention_pairs"]
    assert record_features(old) == StepFeatures(64, 0, 100, 0)


def test_fit_recovers_a_scale_and_an_overhead() -> None:
    rng = random.Random(3)
    features = [StepFeatures(rng.choice([0, 0, 0, 96, 576]), rng.randint(0, 6), rng.randint(50, 1200))
                for _ in range(80)]
    steps = [(f, 1.25 * MODEL.predict(f) + 0.004 + rng.gauss(0, 1e-4)) for f in features]
    k, g = fit_scale_and_overhead(MODEL, steps)
    assert k == pytest.approx(1.25, rel=0.01) and g == pytest.approx(0.004, abs=5e-4)
    # a negative intercept is not an overhead: k alone
    k, g = fit_scale_and_overhead(MODEL, [(f, 0.9 * MODEL.predict(f) - 0.01) for f in features])
    assert g == 0.0 and 0.8 < k < 0.9
    with pytest.raises(ValueError, match="at least 2"):
        fit_scale_and_overhead(MODEL, steps[:1])


def test_a_model_fitted_over_the_server_steps_keeps_k_at_one() -> None:
    # calibrate's case: its step model's fit took the server's steps in, so only g is fitted on them
    rng = random.Random(4)
    features = [StepFeatures(rng.choice([0, 0, 0, 96, 576]), rng.randint(0, 6), rng.randint(50, 1200))
                for _ in range(80)]
    exact = [(f, MODEL.predict(f) + 0.003) for f in features]
    assert fit_scale_and_overhead(MODEL, exact, scale=False) == pytest.approx((1.0, 0.003))
    faster = [(f, 0.95 * MODEL.predict(f)) for f in features]  # the machine sped up: still k = 1, g = 0
    assert fit_scale_and_overhead(MODEL, faster, scale=False) == (1.0, 0.0)
    assert fit_scale_and_overhead(MODEL, faster)[0] == pytest.approx(0.95)


def test_the_simulator_runs_steps_at_the_servers_scale_and_overhead() -> None:
    flat = StepModel(a=0.005, b=0.0, c=0.003, d=0.0)
    base = Profile(step_model=flat, model="m", dtype="float32", machine={}, vocab_size=1000, max_model_len=4096,
                   kv_bytes_per_token=46080, request_overhead_s=0.02)
    served = Profile(**{**base.__dict__, "step_scale": 1.5, "step_overhead_s": 0.001})
    config = SimConfig(num_prompts=2, input_len=16, output_len=5)
    assert simulate(base, config).itl_ms["p50"] == pytest.approx(8.0)
    r = simulate(served, config)
    assert r.itl_ms["p50"] == pytest.approx(1.5 * 8.0 + 1.0)
    assert r.ttft_ms["p50"] == pytest.approx(20.0 + 1.5 * 5.0 + 1.0)


def test_fit_holds_when_slow_outliers_pull_the_first_pass_off_the_bulk() -> None:
    # A calibration server's steps on a Sapphire Rapids box: many tight decode steps and a few long
    # prefills that ran 10-40 % slow. Their pull on the first least-squares pass left the decode
    # steps' residuals all below zero; outliers measured from zero instead of the median then left
    # 3 steps of 125 and fitted k = 0, g = 44 ms.
    rng = random.Random(5)
    decode = [StepFeatures(0, 1, 100)] * 60 + [StepFeatures(0, 6, 600)] * 30 + [StepFeatures(0, 16, 4200)] * 30
    steps = [(f, MODEL.predict(f) * (1 + rng.gauss(0, 0.004))) for f in decode]
    steps += [(StepFeatures(480, 1, 577), MODEL.predict(StepFeatures(480, 1, 577)) * rng.uniform(1.2, 1.4))
              for _ in range(6)]
    k, g = fit_scale_and_overhead(MODEL, steps)
    assert k == pytest.approx(1.0, abs=0.02) and g < 0.002


def test_with_k_at_one_a_server_pays_per_step_and_per_decoding_sequence() -> None:
    """calibrate's fit: wall = model + g + g_seq x decoding sequences (each sequence's token costs the
    API process work beside the next step, on shared cores); the simulator adds both, here only."""
    decode = [StepFeatures(0, n, 300 * n) for n in (1, 1, 1, 6, 6, 16, 16, 16)] * 5 + [StepFeatures(96, 5, 700)] * 3
    steps = [(f, MODEL.predict(f) + 0.001 + 0.0004 * f.decode_seqs) for f in decode]
    assert fit_overheads(MODEL, steps) == pytest.approx((0.001, 0.0004))
    run = ServerRun(tuple(steps), lone_prefills_s=(0.05,), lone_ttft_p50_s=0.06)
    fit = run.fit(MODEL, scale=False)
    assert (fit.step_scale, fit.step_overhead_s, fit.step_overhead_per_seq_s) == pytest.approx((1.0, 0.001, 0.0004))
    assert fit.request_overhead_s == pytest.approx(0.06 - 0.05 - 0.001 - 0.0004)  # the lone step's server share
    assert fit_overheads(MODEL, [(f, 0.9 * MODEL.predict(f)) for f in decode]) == (0.0, 0.0)  # never negative

    flat = StepModel(a=0.005, b=0.0, c=0.003, d=0.0)
    base = Profile(step_model=flat, model="m", dtype="float32", machine={}, vocab_size=1000, max_model_len=4096,
                   kv_bytes_per_token=46080, step_overhead_s=0.001, step_overhead_per_seq_s=0.002)
    one = simulate(base, SimConfig(concurrency=1, num_prompts=2, input_len=16, output_len=5))
    four = simulate(base, SimConfig(concurrency=4, num_prompts=4, input_len=16, output_len=5))
    assert one.itl_ms["p50"] == pytest.approx(8.0 + 1.0 + 2.0)
    assert four.itl_ms["p50"] == pytest.approx(5.0 + 4 * 3.0 + 1.0 + 4 * 2.0)


def test_the_server_overheads_come_from_its_pure_decode_steps() -> None:
    """Mixed prefill steps the model prices loosely (here 30 % over it) do not move g and g_seq."""
    decode = [StepFeatures(0, n, 300 * n) for n in (1, 1, 1, 6, 6, 16, 16, 16)] * 5
    steps = [(f, MODEL.predict(f) + 0.0025 + 0.0002 * f.decode_seqs) for f in decode]
    mixed = [(StepFeatures(96, n, 300 * n + 96), 0.7 * MODEL.predict(StepFeatures(96, n, 300 * n + 96)))
             for n in (1, 5, 15)] * 10
    assert fit_overheads(MODEL, steps + mixed) == pytest.approx((0.0025, 0.0002))

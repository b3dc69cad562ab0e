"""The step-time fit and the features it is fitted on."""

from __future__ import annotations

import math
import random

import pytest

from tokenline.model.batch import FUSED_DECODE_ROWS, ScheduledBatch, ScheduledSeq
from tokenline.sampling_params import SamplingParams
from tokenline.sim.step_model import StepFeatures, StepModel, batch_features, fit_step_model


def test_fit_recovers_known_coefficients_from_noisy_synthetic_steps() -> None:
    # a decode batch that costs less per sequence as it grows: the log term
    truth = StepModel(a=0.004, b=0.0012, c=0.0007, d=2.5e-6, e=0.02, f=0.025)
    rng = random.Random(7)
    features = [
        StepFeatures(rng.choice([0, 0, 16, 128, 512]), rng.randint(0, 32), rng.randint(0, 20_000)) for _ in range(200)
    ]
    durations = [truth.predict(f) + rng.gauss(0, 1e-4) for f in features]  # timer noise: 0.1 ms
    fit = fit_step_model(features, durations)
    for name in ("a", "b", "c", "d", "e", "f"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert 0.5e-4 < fit.residual_rms_s < 2e-4 and 0 < fit.residual_rms_rel < 0.01


def test_steps_slowed_by_another_process_are_left_out_and_no_coefficient_goes_negative() -> None:
    truth = StepModel(a=0.04, b=0.003, c=0.012, d=7e-6)
    rng = random.Random(1)
    features = [StepFeatures(rng.choice([0, 0, 32, 128, 384]), rng.randint(0, 8), rng.randint(30, 2500))
                for _ in range(140)]
    # one step in five ran 1.5-4x slower: a shared machine
    durations = [truth.predict(f) * (1 + (rng.random() < 0.2) * rng.uniform(0.5, 3)) + rng.gauss(0, 0.002)
                 for f in features]
    fit = fit_step_model(features, durations)
    assert fit.a == pytest.approx(0.04, rel=0.1) and fit.b == pytest.approx(0.003, rel=0.05)
    assert fit.c == pytest.approx(0.012, rel=0.1) and fit.residual_rms_s < 0.004
    # decode sequences that cost nothing measurable: c is 0, not a negative speed-up
    flat = [StepFeatures(p, s, 0) for p, s in [(0, 1), (64, 0), (0, 8), (128, 4), (16, 2), (0, 3), (32, 5), (96, 0),
                                              (0, 12)]]
    fit = fit_step_model(flat, [0.01 + 0.002 * f.prefill_tokens - 1e-4 * f.decode_seqs for f in flat])
    assert fit.c == 0.0 and min(fit.a, fit.b, fit.d) >= 0.0


def test_exact_data_fits_exactly_and_prediction_never_goes_negative() -> None:
    truth = StepModel(a=0.01, b=0.002, c=0.003, d=1e-5)
    features = [StepFeatures(p, s, c) for p, s, c in
                [(0, 1, 10), (64, 0, 64), (0, 8, 800), (128, 4, 900), (16, 2, 50), (0, 3, 40), (32, 1, 70),
                 (96, 0, 96), (0, 16, 1600), (256, 2, 600)]]
    fit = fit_step_model(features, [truth.predict(f) for f in features])
    assert fit.residual_rms_s == pytest.approx(0.0, abs=1e-12)
    assert fit.c == pytest.approx(0.003, rel=1e-6)
    assert StepModel(a=-1.0, b=0, c=0, d=0).predict(StepFeatures(0, 1, 1)) == 0.0


def test_fit_needs_as_many_steps_as_coefficients() -> None:
    with pytest.raises(ValueError, match="at least 9"):
        fit_step_model([StepFeatures(1, 0, 1)] * 8, [0.1] * 8)
    with pytest.raises(ValueError, match="durations"):
        fit_step_model([StepFeatures(1, 0, 1)] * 9, [0.1] * 8)


def test_batch_features_tell_decode_from_prefill_and_count_attended_positions() -> None:
    params = SamplingParams()
    prompt = list(range(100))
    batch = ScheduledBatch([
        # a prompt chunk: positions 32..95 attend to 96 positions
        ScheduledSeq("p", prompt[32:96], 32, [], False, params, prompt_token_ids=prompt),
        # the prompt's last token alone is still prefill
        ScheduledSeq("q", prompt[99:], 99, [], True, params, prompt_token_ids=prompt),
        # decoding: one token past a 100-token prompt with 5 outputs
        ScheduledSeq("d", [7], 104, [], True, params, prompt_token_ids=prompt, output_token_ids=[1, 2, 3, 4, 5]),
    ])
    # query-key pairs of the prefill chunks: 64 tokens over 32 cached attend to 33..96 positions, the
    # last prompt token to 100; the decode row's attention is its context
    assert batch_features(batch) == StepFeatures(prefill_tokens=65, decode_seqs=1,
                                                 attended_context_tokens=96 + 100 + 105,
                                                 prefill_attention_pairs=sum(range(33, 97)) + 100)


def test_the_fused_decode_regime_has_its_own_step_price() -> None:
    """Steps of up to FUSED_DECODE_ROWS tokens (decode rows, prefill chunks and drafts alike) run the
    engine's one-call layer; anything longer pays the torch operators' dispatch (f)."""
    cap = FUSED_DECODE_ROWS
    assert [StepFeatures(0, n, 10).unfused for n in (0, 1, 4, cap, cap + 1)] == [1, 0, 0, 0, 1]
    assert StepFeatures(16, 1, 10).unfused == 0  # a short prefill chunk beside one decode row
    assert StepFeatures(cap, 1, 10).unfused == 1  # one token too many
    assert StepFeatures(0, 0, 0).unfused == 1  # no tokens: nothing runs fused
    # Synthetic steps where a step of `cap` tokens costs the fused price and one more token adds the
    # dispatch: a smooth curve alone misfits both sides of the jump, the term takes it.
    truth = StepModel(a=0.005, b=0.001, c=0.004, d=1e-6, e=0.0, f=0.025)
    features = [StepFeatures(p, n, 100 * n) for p in (0, 8, cap) for n in range(1, cap + 9, 3)]
    fit = fit_step_model(features, [truth.predict(f) for f in features])
    assert fit.f == pytest.approx(0.025, rel=1e-6) and fit.residual_rms_s < 1e-9
    jump = fit.predict(StepFeatures(0, cap + 1, 100 * (cap + 1))) - fit.predict(StepFeatures(0, cap, 100 * cap))
    assert jump == pytest.approx(0.025 + 0.004 + 1e-4)


def test_hinges_at_knots_follow_a_decode_curve_that_bends_upwards(tmp_path) -> None:
    """A step bound by the weights' read at few sequences and by arithmetic beyond: the per-sequence
    cost rises past a knot. A straight line through 1..32 sequences misprices the middle; hinges at
    the design's inner batch sizes take the bend, and round-trip through a profile file."""
    from tokenline.sim.profile import Profile

    truth = StepModel(a=0.03, b=0.002, c=0.001, d=1e-6, f=0.02, knots=(4, 8, 16), hinges=(0.002, 0.0, 0.001))
    features = [StepFeatures(p, n, 300 * n) for p in (0, 0, 32) for n in (1, 2, 4, 8, 12, 16, 24, 32)]
    features += [StepFeatures(p, 0, p) for p in (32, 64, 96, 128, 384)]
    durations = [truth.predict(f) for f in features]
    line = fit_step_model(features, durations)
    bent = fit_step_model(features, durations, knots=(4, 8, 16))
    middle = StepFeatures(0, 8, 2400)
    assert abs(line.predict(middle) / truth.predict(middle) - 1) > 0.03
    assert bent.predict(middle) == pytest.approx(truth.predict(middle), rel=1e-6)
    assert bent.hinges == pytest.approx((0.002, 0.0, 0.001), abs=1e-9) and bent.residual_rms_s < 1e-9
    assert bent.scaled(2.0).predict(middle) == pytest.approx(2 * truth.predict(middle), rel=1e-9)
    profile = Profile(step_model=bent, model="m", dtype="float32", machine={}, vocab_size=10, max_model_len=64,
                      kv_bytes_per_token=4)
    profile.write(tmp_path / "p.json")
    assert Profile.read(tmp_path / "p.json").step_model == bent
    with pytest.raises(ValueError, match="hinge"):
        StepModel(a=0, b=0, c=0, d=0, knots=(4,), hinges=())


def test_a_prefill_hinge_at_the_best_of_its_candidate_knots(tmp_path) -> None:
    """Prefill tokens that cost more each past some step size (2.8 ms a token to ~900 tokens, 3.4 at
    2048 on the CPU here): one slope misprices both ends; the fit tries each candidate knot and
    keeps the closest, and the profile round-trips it."""
    from tokenline.sim.profile import Profile

    truth = StepModel(a=0.02, b=0.0028, c=0.003, d=5e-6, prefill_knot=1024, prefill_hinge=0.0012)
    rng = random.Random(3)
    features = [StepFeatures(p, n, 200 * n + p) for p in (0, 0, 32, 128, 384, 512, 896, 1024, 1536, 2048)
                for n in (0, 1, 8, 16) if p + n]
    durations = [truth.predict(f) * (1 + rng.gauss(0, 0.01)) for f in features]
    line = fit_step_model(features, durations)
    hinged = fit_step_model(features, durations, prefill_knots=(512, 1024, 1536, 4096))  # 4096: past every step
    assert (line.prefill_knot, line.prefill_hinge) == (0, 0.0)
    assert hinged.prefill_knot == 1024 and hinged.prefill_hinge == pytest.approx(0.0012, rel=0.15)
    for p in (128, 2048):
        f = StepFeatures(p, 0, p)
        assert hinged.predict(f) == pytest.approx(truth.predict(f), rel=0.03)
    # one slope, fitted by relative error, keeps the many short steps and misprices the long ones
    assert max(abs(line.predict(StepFeatures(p, 0, p)) / truth.predict(StepFeatures(p, 0, p)) - 1)
               for p in (1536, 2048)) > 0.05

    def relative_rms(m: StepModel) -> float:
        return math.sqrt(sum((m.predict(f) / w - 1) ** 2 for f, w in zip(features, durations)) / len(features))

    assert relative_rms(hinged) < relative_rms(line) / 2
    # Scaled apart: decode terms by one factor, the prefill slope and hinge by another.
    f = StepFeatures(2048, 4, 3000)
    both = hinged.scaled(1.5, 0.5)
    decode_part = hinged.predict(f) - hinged.prefill_s(f)
    assert both.predict(f) == pytest.approx(1.5 * decode_part + 0.5 * hinged.prefill_s(f), rel=1e-9)
    profile = Profile(step_model=hinged, model="m", dtype="float32", machine={}, vocab_size=10, max_model_len=64,
                      kv_bytes_per_token=4)
    profile.write(tmp_path / "p.json")
    assert Profile.read(tmp_path / "p.json").step_model == hinged


def fresh(p: int, decode: int = 0, context: int = 0) -> StepFeatures:
    return StepFeatures(p, decode, p + context, p * (p + 1) // 2)


def followup(new: int, cached: int) -> StepFeatures:
    return StepFeatures(new, 0, cached + new, new * cached + new * (new + 1) // 2)


def test_prefill_attention_pairs_price_a_chunk_over_a_cached_prefix() -> None:
    """A chat's next turn prefills a few dozen tokens over hundreds cached: its attention grows with
    its tokens times that context, which the context term counts once. On the calibration's shapes
    the fit finds q and prices such turns; a fit whose features lack the pairs spreads their cost
    over the per-token slope and the fixed cost, and prices a short turn over a long prefix low and
    a fresh short prompt high (as the simulator did: multi-turn TTFT -10 %)."""
    truth = StepModel(a=0.02, b=0.0028, c=0.003, d=4e-6, e=0.004, q=1.2e-6, knots=(4, 8, 16), hinges=(0.0, 0.0, 0.0),
                      q_fused=2.4e-6, b_fused=0.0014)
    rng = random.Random(5)
    # lone prompts, decode batches' prompts prefilled 2048 tokens a step (8 x 256, 2 x 1024, ...),
    # follow-ups over cached prefixes, decode steps
    features = [fresh(p) for p in (32, 64, 96, 128, 384)]
    features += [StepFeatures(n * p, 0, n * p, n * p * (p + 1) // 2)
                 for n, p in ((8, 256), (2, 1024), (4, 256), (1, 1024))]
    features += [followup(n, s) for s in (256, 512, 1024) for n in (32, 64, 128)]
    features += [StepFeatures(0, b, b * ctx) for b in (1, 4, 8, 16, 32) for ctx in (32, 256, 1024)]
    features *= 2
    durations = [truth.predict(f) * (1 + rng.gauss(0, 0.005)) for f in features]
    knots, prefill_knots = (4, 8, 16), (512, 1024, 1536)
    fit = fit_step_model(features, durations, knots, prefill_knots)
    blind = fit_step_model([StepFeatures(f.prefill_tokens, f.decode_seqs, f.attended_context_tokens) for f in features],
                           durations, knots, prefill_knots)
    assert fit.q == pytest.approx(1.2e-6, rel=0.15) and fit.q_fused == pytest.approx(2.4e-6, rel=0.15)
    assert blind.q == pytest.approx(0.0, abs=1e-12) and blind.q_fused == pytest.approx(0.0, abs=1e-12)
    # the one-call layer's prefill tokens have their own price too; a profile from before it has none
    assert fit.b_fused == pytest.approx(0.0014, rel=0.15)
    old = StepModel(a=0.02, b=0.0028, c=0.003, d=4e-6)
    assert old.predict(fresh(32)) == pytest.approx(0.02 + 32 * 0.0028 + 32 * 4e-6)
    turn, short_over_long = followup(70, 450), followup(32, 1024)  # the multi-turn workload's turns (docs/benchmarks)
    for f in (turn, short_over_long, fresh(128)):
        assert fit.predict(f) == pytest.approx(truth.predict(f), rel=0.03)
    assert blind.predict(turn) < 0.95 * truth.predict(turn)
    assert blind.predict(short_over_long) < 0.9 * truth.predict(short_over_long)
    assert blind.predict(fresh(128)) > 1.05 * truth.predict(fresh(128))
    # q is a prefill coefficient: part of prefill_s, and scaled with the prefill factor
    assert fit.prefill_s(turn) == pytest.approx(
        fit.prefill_s(StepFeatures(70, 0, 520)) + fit.q * turn.prefill_attention_pairs)
    both = fit.scaled(1.0, 2.0)
    assert both.q == pytest.approx(2 * fit.q) and both.q_fused == pytest.approx(2 * fit.q_fused)
    for f in (turn, short_over_long):
        assert both.predict(f) == pytest.approx(fit.predict(f) + fit.prefill_s(f), rel=1e-9)


def test_steps_a_server_measured_get_their_own_intercept() -> None:
    """A server's step walls hold what it adds to every step (outputs sent, requests read): with
    ``in_server`` that goes to an intercept of their own, and the engine's own prices stay exact."""
    truth = StepModel(a=0.012, b=0.0006, c=0.0004, d=1e-6, f=0.015, knots=(4, 8, 16), hinges=(0.0003, 0.0, 0.0002))
    offline = [StepFeatures(p, n, 300 * n + p) for p in (0, 32, 64, 96, 384) for n in (0, 1, 4, 8, 16, 32) if p + n]
    served = [StepFeatures(0, n, 500 * n) for n in (1, 1, 2, 6, 6, 16, 16)] + [StepFeatures(64, 3, 1500)]
    durations = [truth.predict(f) for f in offline] + [truth.predict(f) + 0.003 for f in served]
    flags = [False] * len(offline) + [True] * len(served)
    shared = fit_step_model(offline + served, durations, knots=(4, 8, 16))
    apart = fit_step_model(offline + served, durations, knots=(4, 8, 16), in_server=flags)
    probe = StepFeatures(0, 1, 300)
    assert apart.predict(probe) == pytest.approx(truth.predict(probe), rel=1e-6)
    assert apart.a == pytest.approx(truth.a, rel=1e-6) and apart.residual_rms_s < 1e-9
    assert abs(shared.predict(probe) / truth.predict(probe) - 1) > 0.01  # one intercept for both misprices
    with pytest.raises(ValueError, match="in_server"):
        fit_step_model(offline, durations[: len(offline)], in_server=[True])


def test_with_hinges_the_log_term_is_left_out() -> None:
    """Hinges at every inner batch size already pass a line through each measured batch; the log
    term on top only trades off against them (an ill-conditioned fit), so a hinged fit keeps e = 0
    and two noisy measurements of one curve price its batches alike."""
    truth = StepModel(a=0.012, b=0.0006, c=0.0003, d=1e-6, knots=(4, 8, 16), hinges=(0.0005, 0.0, 0.0002))
    features = [StepFeatures(p, n, 200 * n + p) for p in (0, 0, 32, 128) for n in (1, 4, 8, 16, 32)]
    features += [StepFeatures(p, 0, p) for p in (32, 64, 96, 384)]
    fits = []
    for seed in (1, 2):
        rng = random.Random(seed)
        durations = [truth.predict(f) * (1 + rng.gauss(0, 0.02)) for f in features]
        fits.append(fit_step_model(features, durations, knots=(4, 8, 16)))
    for n in (1, 4, 8, 16, 32):
        f = StepFeatures(0, n, 200 * n)
        assert [fit.e for fit in fits] == [0.0, 0.0]
        assert fits[0].predict(f) == pytest.approx(truth.predict(f), rel=0.05)
        assert fits[0].predict(f) == pytest.approx(fits[1].predict(f), rel=0.05)

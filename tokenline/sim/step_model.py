"""The step-time model: step_s = a + (b or b_fused)·prefill_tokens + b'·max(0, prefill_tokens − p)
+ c·decode_seqs + e·log2(1 + decode_seqs) + Σ_k h_k·max(0, decode_seqs − k) + d·attended_context_tokens
+ (q or q_fused)·prefill_attention_pairs + f·[off the fused path], the _fused prices for a step the
one-call layer takes.

The log term is how a decode batch costs less per sequence as it grows (on the CPU here one decode
sequence took 65 ms, 8 took 175 ms and 32 took 278 ms: a GEMV becoming a GEMM); the linear one
keeps what grows with the batch at any size (a fit with hinges leaves the log term out:
``fit_step_model``). The hinges (at knots k, the calibration design's
inner decode batch sizes) let the per-sequence cost rise past a knot instead: on the CPU here a
decode step is bound by reading the weights at a few sequences and by the linears' arithmetic
beyond, so its curve bends upwards, and a straight line through 1..32 sequences put 8-sequence
steps 14-17 % too slow (two sessions). The last is a step's price for leaving the engine's
one-call decode layer (a step of more than ``FUSED_DECODE_ROWS`` tokens: the torch operators'
dispatch, ~25 ms a step on the 2-core CPU here); without it, a fit over both regimes put
small-batch multi-turn decode steps 23-39 % too slow. A step past ``prefill_knot`` prefill tokens
may cost more per token (``prefill_hinge``): on the CPU here a 2048-token step cost 3.4 ms a token
and a 128- to 896-token one 2.8, which one slope put 15 % high at c=1 and c=8 (their TTFT +10-20 %).
A prefill chunk's attention costs its query-key pairs: n new tokens after s cached ones attend to
n·s + n(n+1)/2 positions, where ``d`` counts the chunk's context once (its KV read, right for a
decode row). Without them, a multi-turn chat's follow-up prefills (~70 tokens over 300-550 cached)
ran ~15 % slower than the model priced them (its TTFT -10 %). The two paths price a pair apart:
the torch operators' SDPA over the gathered context (``q``), and the one-call layer, where every
prefill token is a decode query over its own context (``q_fused``; 32 tokens over 1024 cached took
~2.5 us a pair there against SDPA's ~0.9 on the Ice Lake Xeon here). That layer's prefill tokens
cost less each than the torch path's (``b_fused``: 1.2-1.5 ms against 2.3-2.5 there), which one
slope put 24 % high for a 32-token prompt.

Fitted by least squares on step records of the real engine (``calibrate``), and used by the
simulator's runner to advance its clock (``simulate``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenline.model.batch import FUSED_DECODE_ROWS, ScheduledBatch


@dataclass(frozen=True)
class StepFeatures:
    """What one step computed, in the terms of the model."""

    prefill_tokens: int
    decode_seqs: int
    attended_context_tokens: int  # per sequence, every position its new tokens attend to (the KV read)
    prefill_attention_pairs: int = 0  # prefill chunks' query-key pairs (ScheduledSeq.attention_pairs)
    # Sliding-window models: the same two counted as a sliding layer sees them (each query's keys
    # capped at the window). None: no window (every layer sees the whole context).
    windowed_context_tokens: int | None = None
    windowed_attention_pairs: int | None = None

    @property
    def unfused(self) -> int:
        """1 when the engine runs this step through torch operators, not its one-call decode layer
        (which takes any step of at most FUSED_DECODE_ROWS tokens)."""
        return int(not 0 < self.prefill_tokens + self.decode_seqs <= FUSED_DECODE_ROWS)


@dataclass(frozen=True)
class StepModel:
    a: float  # seconds per step
    b: float  # seconds per prefill token
    c: float  # seconds per decoding sequence
    d: float  # seconds per attended context token
    residual_rms_s: float = 0.0  # root-mean-square error of the fit on its own records
    e: float = 0.0  # seconds per log2(1 + decoding sequences)
    f: float = 0.0  # seconds per step off the fused decode path (0 in profiles written before it)
    knots: tuple[int, ...] = ()  # decode batch sizes where the per-sequence cost may change
    hinges: tuple[float, ...] = ()  # seconds per decoding sequence past each knot, on top of c
    prefill_knot: int = 0  # prefill tokens in a step past which each costs prefill_hinge more (0: none)
    prefill_hinge: float = 0.0
    q: float = 0.0  # seconds per prefill query-key pair off the fused path (0 in profiles before it)
    q_fused: float = 0.0  # seconds per prefill query-key pair in the one-call layer
    b_fused: float | None = None  # seconds per prefill token in the one-call layer (None: b, as before it)
    residual_rms_rel: float = 0.0  # the fit's rms relative error on its own records (what it minimised)

    def __post_init__(self) -> None:
        # A profile read back from JSON gives lists.
        object.__setattr__(self, "knots", tuple(int(k) for k in self.knots))
        object.__setattr__(self, "hinges", tuple(float(h) for h in self.hinges))
        if len(self.knots) != len(self.hinges):
            raise ValueError(f"{len(self.knots)} knots but {len(self.hinges)} hinge coefficients")

    def predict(self, f: StepFeatures) -> float:
        # A negative coefficient fitted on noise must never make time run backwards.
        past_knots = sum(h * max(0, f.decode_seqs - k) for k, h in zip(self.knots, self.hinges))
        return max(0.0, self.a + self.prefill_s(f) + self.c * f.decode_seqs + past_knots
                   + self.e * math.log2(1 + f.decode_seqs) + self.d * f.attended_context_tokens + self.f * f.unfused)

    def prefill_s(self, f: StepFeatures) -> float:
        """What a step's prefill tokens themselves cost: the slope, the hinge past its knot, and
        their attention's query-key pairs at the price of the path the step takes."""
        past = max(0, f.prefill_tokens - self.prefill_knot) if self.prefill_knot else 0
        b, q = (self.b, self.q) if f.unfused else (self.b if self.b_fused is None else self.b_fused, self.q_fused)
        return b * f.prefill_tokens + self.prefill_hinge * past + q * f.prefill_attention_pairs

    def scaled(self, factor: float, prefill_factor: float | None = None) -> StepModel:
        """Every coefficient times ``factor`` (the model is linear in them); the prefill ones (b, the
        prefill hinge, q and q_fused) times ``prefill_factor`` where given."""
        pf = factor if prefill_factor is None else prefill_factor
        return StepModel(self.a * factor, self.b * pf, self.c * factor, self.d * factor, self.residual_rms_s,
                         self.e * factor, self.f * factor, self.knots, tuple(h * factor for h in self.hinges),
                         self.prefill_knot, self.prefill_hinge * pf, self.q * pf, self.q_fused * pf,
                         None if self.b_fused is None else self.b_fused * pf, self.residual_rms_rel)


def batch_features(batch: ScheduledBatch, window: int | None = None) -> StepFeatures:
    """The features of a scheduled batch: a sequence computing one token past its prompt decodes
    (drafts beside it count as prefill tokens here); any other chunk is prefill. ``window``: the
    model's sliding window, whose layers' share of the attention is counted apart."""
    prefill = decode = context = pairs = windowed = windowed_pairs = 0
    for seq in batch.seqs:
        n = len(seq.token_ids)
        is_decode = n - len(seq.draft_token_ids) == 1 and seq.start_pos >= len(seq.prompt_token_ids)
        if is_decode:
            decode += 1
            prefill += len(seq.draft_token_ids)
        else:
            prefill += n
            pairs += seq.attention_pairs
        context += seq.start_pos + n
        if window is not None:
            windowed += min(seq.start_pos + n, window + n - 1)
            windowed_pairs += 0 if is_decode else windowed_pair_count(seq.start_pos, n, window)
    if window is None:
        return StepFeatures(prefill, decode, context, pairs)
    return StepFeatures(prefill, decode, context, pairs, windowed, windowed_pairs)


def windowed_pair_count(start_pos: int, num_tokens: int, window: int) -> int:
    """Query-key pairs of a chunk whose query at position p sees min(p + 1, window) keys."""
    low, high = start_pos + 1, start_pos + num_tokens  # each query's keys before the cap
    ramp_end = min(high, window)
    ramp = (ramp_end * (ramp_end + 1) - (low - 1) * low) // 2 if ramp_end >= low else 0
    return ramp + max(0, high - max(low - 1, window)) * window


def fit_step_model(features: Sequence[StepFeatures], durations_s: Sequence[float],
                   knots: Sequence[int] = (), prefill_knots: Sequence[int] = (),
                   in_server: Sequence[bool] | None = None) -> StepModel:
    """Least-squares fit of the coefficients (nine, plus a hinge per knot) to measured step times,
    each step by its relative error, robust to a shared machine: no coefficient below zero (no
    feature makes a step faster; hinges only steepen the curve), and steps more than 3 scaled MADs
    off the fit (another process took the core) are left out and the rest refitted.
    ``residual_rms_s`` and ``residual_rms_rel`` are over the steps kept.

    ``prefill_knots``: candidate knots for the prefill hinge; each below the largest prefill step is
    fitted and the one whose fit is closest over every step (kept or not, relative errors) is taken.

    With ``knots``, the log term is left out (e = 0): hinges at every inner batch size of a design
    already draw a line through each measured batch, and the two together were ill-conditioned
    (three quiet calibrations fitted e = 0.68, 2.85 and 0.67 ms, the hinge past 4 making up for it,
    and simulated 10-25 % apart). ``in_server``: which steps a real server measured (their wall
    time, outputs sent and requests read included); they get an intercept and a price per decoding
    sequence of their own, so that what a server adds to each step (``server_fit``'s g and g_seq)
    does not raise the engine's own prices (a shared intercept put the offline steps' 1.7 ms high
    and a server's batch-1 decode steps 9-16 % over the fit)."""
    if len(features) != len(durations_s):
        raise ValueError(f"{len(features)} feature rows but {len(durations_s)} durations")
    if in_server is not None and len(in_server) != len(features):
        raise ValueError(f"{len(features)} feature rows but {len(in_server)} in_server flags")
    largest = max((f.prefill_tokens for f in features), default=0)
    fits = [_fit(features, durations_s, knots, k, in_server)
            for k in (0, *(k for k in prefill_knots if 0 < k < largest))]
    return min(fits, key=lambda fit: fit[1])[0]


def _fit(features: Sequence[StepFeatures], durations_s: Sequence[float], knots: Sequence[int],
         prefill_knot: int, in_server: Sequence[bool] | None = None) -> tuple[StepModel, float]:
    """One fit (``prefill_knot`` 0: no prefill hinge) and its relative rms over every step."""
    server = in_server is not None and any(in_server)
    columns = 9 + len(knots) + bool(prefill_knot) + 2 * server - bool(knots)
    if len(features) < columns:
        raise ValueError(f"need at least {columns} steps to fit {columns} coefficients, got {len(features)}")
    log_term = not knots
    x = np.array([[1.0, f.prefill_tokens * f.unfused, f.decode_seqs, math.log2(1 + f.decode_seqs) * log_term,
                   f.attended_context_tokens, f.unfused, f.prefill_attention_pairs * f.unfused,
                   f.prefill_attention_pairs * (1 - f.unfused), f.prefill_tokens * (1 - f.unfused),
                   *(max(0, f.decode_seqs - k) for k in knots),
                   *((max(0, f.prefill_tokens - prefill_knot),) if prefill_knot else ())] for f in features])
    if server:  # the server steps' own intercept and price a sequence: fitted beside the rest, left to server_fit
        flags = np.asarray(in_server, dtype=np.float64)
        x = np.hstack([x, flags[:, None], (flags * [f.decode_seqs for f in features])[:, None]])
    y = np.asarray(durations_s, dtype=np.float64)
    # Each step weighs by its relative error: in plain least squares the few multi-second prefill
    # steps set the price of the short ones (a 32-token prefill came out 24 % high on the Ice Lake
    # Xeon), and a simulation's TTFT at c=1 is one short step.
    weight = relative_weight(y)
    coef, keep = robust_lstsq(x * weight[:, None], y * weight)
    residual = x @ coef - y
    relative = residual * weight
    rms = float(np.sqrt(np.mean(residual[keep] ** 2)))
    rms_rel = float(np.sqrt(np.mean(relative[keep] ** 2)))
    a, b, c, e, d, off, q, q_fused, b_fused = (float(v) for v in coef[:9])
    hinges = tuple(float(v) for v in coef[9 : 9 + len(knots)])
    prefill_hinge = float(coef[9 + len(knots)]) if prefill_knot else 0.0
    model = StepModel(a, b, c, d, rms, e, off, tuple(knots), hinges, prefill_knot, prefill_hinge, q, q_fused, b_fused,
                      rms_rel)
    return model, float(np.sqrt(np.mean(relative**2)))


def relative_weight(seconds: np.ndarray) -> np.ndarray:
    """Row weights that make least squares minimise relative error (a floor of 1 ms, so a
    near-zero measurement cannot dominate): ``robust_lstsq(x * w[:, None], y * w)``."""
    return 1.0 / np.maximum(seconds, 1e-3)


def robust_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares that leaves out rows more than 3 scaled MADs from the kept rows'
    median residual and refits (a few rounds). Returns the coefficients and which rows were kept."""
    keep = np.ones(len(y), dtype=bool)
    coef = _nonnegative_lstsq(x, y)
    for _ in range(5):
        residual = y - x @ coef
        # Distances from the median, not from zero: a first fit that slow outliers pulled up leaves
        # the bulk's residuals off zero, and a band around zero then cut all but 3 of a calibration
        # server's 125 steps (their median -6.7 ms, the spread 3.0 ms) and fitted k = 0 on the rest.
        centre = float(np.median(residual[keep]))
        spread = 1.4826 * float(np.median(np.abs(residual[keep] - centre)))
        new_keep = np.abs(residual - centre) <= max(3 * spread, 1e-9)
        if new_keep.sum() < x.shape[1] or (new_keep == keep).all():
            break
        keep = new_keep
        coef = _nonnegative_lstsq(x[keep], y[keep])
    return coef, keep


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and refit until none is."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sub, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sub >= 0).all():
            coef[active] = sub
            return coef
        del active[int(np.argmin(sub))]
    return coef

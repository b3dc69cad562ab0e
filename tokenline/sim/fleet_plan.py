"""``tokenline plan --accelerator``: from a traffic forecast to replicas, settings, latency and cost
per million tokens.

Each candidate replica (the smallest tensor-parallel degree whose weights fit and twice it,
at vLLM's default ``max-num-seqs`` or the ones asked for) runs the real ``Scheduler`` and
``KVCacheManager`` through ``EngineCore`` on a simulated clock, its steps priced by the accelerator step model (``accelerator.py``), under an
open-loop Poisson load of the forecast's requests (lengths drawn from its distributions, a shared
system prompt, multi-turn follow-ups over their history). A sweep of loads gives the
latency–throughput curve; the highest load that meets the SLOs is a replica's capacity; replicas
= peak ÷ capacity with the headroom asked for. The day's cost follows the daily curve (replicas
scaled each hour, never below one), and is split between input and output tokens by the share of
step time the model prices for prefill and for decode.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tokenline.bench.results import stats_ms
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.model.config import ModelConfig
from tokenline.model.kv_groups import group_windows, kv_block_bytes
from tokenline.sampling_params import SamplingParams
from tokenline.sim.accelerator import AcceleratorCost, AcceleratorStepModel, accelerator_cost
from tokenline.sim.machine import Machine
from tokenline.sim.placeholder_runner import PlaceholderRunner, SimClock
from tokenline.sim.sim_target import MEMORY_UTILIZATION
from tokenline.sim.step_model import StepFeatures

# A working day's shape (hour 0-23, peak 1.0): low at night, a morning ramp, an afternoon peak.
DEFAULT_DAILY_CURVE = (0.30, 0.25, 0.22, 0.20, 0.20, 0.22, 0.30, 0.45, 0.62, 0.78, 0.88, 0.94,
                       0.96, 0.98, 1.00, 1.00, 0.97, 0.92, 0.85, 0.78, 0.70, 0.60, 0.48, 0.38)
# Workers AI's published price for @cf/qwen/qwen3.8-27b, US$ per million input / output tokens.
WORKERS_AI_PRICE = (0.45, 3.20)
VLLM_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's default step budget for an API server on a large GPU
LOAD_FRACTIONS = (0.25, 0.5, 0.75, 0.95)  # of a replica's saturated rate, for the curve
TP_DEGREES = (1, 2, 4, 8)


class PlanError(ValueError):
    """A plan that cannot be made (the model fits on no tensor-parallel group, a bad forecast)."""


@dataclass(frozen=True)
class Forecast:
    peak_rps: float
    input_len: int = 1024
    output_len: int = 256
    input_spread: float = 0.5  # coefficient of variation of a log-normal (0: every request the same)
    output_spread: float = 0.5
    shared_prefix_fraction: float = 0.0  # of each first turn's prompt: a system prompt shared by all
    turns: int = 1  # requests per conversation; later turns carry the history (prefix-cached)
    think_time_s: float = 10.0  # between a conversation's turns
    daily_curve: tuple[float, ...] = DEFAULT_DAILY_CURVE

    def __post_init__(self) -> None:
        if not self.peak_rps > 0:
            raise PlanError("the peak must be > 0 requests per second (--peak-rps or --concurrent-users)")
        if min(self.input_len, self.output_len, self.turns) < 1:
            raise PlanError("--input-len, --output-len and --turns must be >= 1")
        if not 0 <= self.shared_prefix_fraction < 1:
            raise PlanError("--shared-prefix-fraction must be in [0, 1)")
        if min(self.input_spread, self.output_spread) < 0 or self.think_time_s < 0:
            raise PlanError("length spreads and --think-time must be >= 0")
        if len(self.daily_curve) != 24 or min(self.daily_curve) <= 0 or max(self.daily_curve) != 1.0:
            raise PlanError("--daily-curve takes 24 hourly loads > 0, the peak hour 1")


def users_to_rps(users: float, think_time_s: float, seconds_per_request: float) -> float:
    """Concurrent users who each send a request, wait for it and think: Little's law."""
    return users / max(think_time_s + seconds_per_request, 1e-9)


@dataclass(frozen=True)
class Slo:
    ttft_p99_ms: float = 2000.0
    tpot_p50_ms: float = 50.0
    tpot_p99_ms: float = 100.0

    def met(self, point: LoadPoint) -> bool:
        return (point.ttft_p99_ms <= self.ttft_p99_ms and point.tpot_p50_ms <= self.tpot_p50_ms
                and point.tpot_p99_ms <= self.tpot_p99_ms and point.completed == point.requests)


@dataclass(frozen=True)
class LoadPoint:
    """One replica under an open-loop load."""

    rps: float  # offered: the arrival rate
    served_rps: float  # completed requests over the run's span
    requests: int
    completed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_tok_s: float
    input_tok_s: float
    prefill_share: float  # of the replica's busy step time, what the model prices for prefill
    busy_share: float  # of the run's time, the replica was stepping
    prefix_hit_rate: float
    steps: int = 0  # engine steps the run simulated


@dataclass
class Candidate:
    tp: int
    max_num_seqs: int
    num_kv_blocks: int
    saturated_rps: float
    curve: list[LoadPoint]
    capacity_rps: float  # the highest load on the curve that meets the SLOs (0: none does)
    steps: int = 0  # engine steps simulated for it (its saturated run and its curve)

    def gpu_hours_per_request(self) -> float:
        return math.inf if self.capacity_rps <= 0 else self.tp / (self.capacity_rps * 3600)


@dataclass
class FleetPlan:
    model: str
    accelerator: str
    price_per_hour: float
    forecast: Forecast
    slo: Slo
    chosen: Candidate
    candidates: list[Candidate]
    replicas: int
    headroom: float  # capacity at the peak over the peak, less 1
    max_num_batched_tokens: int
    block_size: int
    peak: LoadPoint
    off_peak: LoadPoint
    off_peak_replicas: int
    hourly_replicas: list[int]
    daily_cost: float
    cost_per_m_input: float
    cost_per_m_output: float
    hosted_price: tuple[float, float]
    hosted_daily_cost: float
    weights_gb: float
    notes: list[str] = field(default_factory=list)
    simulated_steps: int = 0  # engine steps of every run the plan simulated

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        c, p, o = self.chosen, self.peak, self.off_peak
        gpus = self.replicas * c.tp
        rows = [
            ("model / accelerator", f"{self.model} on {self.accelerator} at ${self.price_per_hour:.2f}/GPU-hour; "
                                    f"weights {self.weights_gb:.1f} GB"),
            ("forecast", f"peak {self.forecast.peak_rps:.4g} req/s, {self.forecast.input_len} in / "
                         f"{self.forecast.output_len} out tokens (mean), shared prefix "
                         f"{self.forecast.shared_prefix_fraction:.0%}, {self.forecast.turns} turn(s); "
                         f"off-peak {min(self.forecast.daily_curve):.0%} of peak"),
            ("SLO", f"TTFT p99 <= {self.slo.ttft_p99_ms:g} ms, TPOT p50 <= {self.slo.tpot_p50_ms:g} ms, "
                    f"p99 <= {self.slo.tpot_p99_ms:g} ms"),
            ("replicas", f"{self.replicas} x (tensor-parallel {c.tp}) = {gpus} GPUs at the peak; "
                         f"{self.off_peak_replicas} off-peak"),
            ("each replica", f"--tensor-parallel-size {c.tp} --max-num-seqs {c.max_num_seqs} "
                             f"--max-num-batched-tokens {self.max_num_batched_tokens}; {c.num_kv_blocks:,} KV blocks "
                             f"of {self.block_size} tokens"),
            ("replica capacity", f"{c.capacity_rps:.2f} req/s within the SLOs (saturates at {c.saturated_rps:.2f})"),
            ("headroom at peak", f"{self.headroom:.0%}"),
            ("at peak (per replica)", _point(p)),
            ("off-peak (per replica)", _point(o)),
            ("fleet throughput at peak", f"{p.output_tok_s * self.replicas:,.0f} output tok/s, "
                                         f"{p.input_tok_s * self.replicas:,.0f} input tok/s"),
            ("cost per day", f"${self.daily_cost:,.0f} (replicas follow the daily curve)"),
            ("cost per M tokens", f"${self.cost_per_m_input:.3f} input, ${self.cost_per_m_output:.3f} output"),
            ("hosted price", f"${self.hosted_price[0]:.2f} input, ${self.hosted_price[1]:.2f} output per M tokens: "
                             f"${self.hosted_daily_cost:,.0f} a day for the same traffic"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append(f"simulated: {self.simulated_steps:,} engine steps")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _point(p: LoadPoint) -> str:
    return (f"{p.rps:.2f} req/s: TTFT p50 {p.ttft_p50_ms:.0f} / p99 {p.ttft_p99_ms:.0f} ms, TPOT p50 "
            f"{p.tpot_p50_ms:.1f} / p99 {p.tpot_p99_ms:.1f} ms, {p.output_tok_s:,.0f} output tok/s, "
            f"busy {p.busy_share:.0%}")


class _SplitRecorder:
    """The step model, noting how much of each step it prices for prefill and for decode."""

    def __init__(self, model: AcceleratorStepModel) -> None:
        self.model = model
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.busy_s = 0.0

    def predict(self, f: StepFeatures) -> float:
        total = self.model.predict(f)
        windowed = f.windowed_context_tokens is not None
        alone_p = self.model.predict(StepFeatures(f.prefill_tokens, 0, 0, f.prefill_attention_pairs,
                                                  0 if windowed else None, f.windowed_attention_pairs)) \
            if f.prefill_tokens else 0.0
        alone_d = self.model.predict(StepFeatures(0, f.decode_seqs, f.attended_context_tokens, 0,
                                                  f.windowed_context_tokens, 0 if windowed else None)) \
            if f.decode_seqs else 0.0
        share = alone_p / (alone_p + alone_d) if alone_p + alone_d > 0 else 0.0
        self.prefill_s += total * share
        self.decode_s += total * (1 - share)
        self.busy_s += total
        return total


@dataclass(frozen=True)
class _Request:
    arrival: float
    prompt: list[int]
    output_len: int


def _lengths(rng: random.Random, mean: int, spread: float, n: int, cap: int) -> list[int]:
    if spread <= 0:
        return [min(mean, cap)] * n
    sigma = math.sqrt(math.log(1 + spread * spread))
    mu = math.log(mean) - sigma * sigma / 2
    return [max(1, min(cap, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def workload(forecast: Forecast, rps: float, num_requests: int, vocab: int, max_len: int,
             seed: int = 0) -> list[_Request]:
    """Open-loop Poisson arrivals at ``rps``: conversations of ``turns`` requests, their starts a
    Poisson process at rps / turns, each later turn ``think_time_s`` after the previous one's
    arrival, its prompt the previous prompt, an answer's worth of tokens and new input."""
    rng = random.Random(seed)
    ids = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return ids.integers(0, vocab, n).tolist()

    turns = forecast.turns
    conversations = max(1, math.ceil(num_requests / turns))
    ins = _lengths(rng, forecast.input_len, forecast.input_spread, conversations * turns, max_len // 2)
    outs = _lengths(rng, forecast.output_len, forecast.output_spread, conversations * turns, max_len // 4)
    shared = tokens(round(forecast.shared_prefix_fraction * forecast.input_len))
    requests, t = [], 0.0
    for c in range(conversations):
        t += rng.expovariate(rps / turns)
        history: list[int] = []
        for k in range(turns):
            i = c * turns + k
            fresh = tokens(ins[i])
            prompt = (shared + fresh if k == 0 else history + fresh)[:max_len - outs[i] - 1]
            requests.append(_Request(t + k * forecast.think_time_s, prompt, outs[i]))
            history = prompt + tokens(outs[i])
    requests.sort(key=lambda r: r.arrival)
    return requests[:num_requests]


def run_open_loop(model: AcceleratorStepModel, requests: list[_Request], num_kv_blocks: int, max_num_seqs: int,
                  max_num_batched_tokens: int, max_model_len: int, num_state_slots: int, vocab: int,
                  request_overhead_s: float, offered_rps: float, block_size: int = 16,
                  num_checkpoints: int = 0, windows: tuple[int | None, ...] = (None,)) -> LoadPoint:
    """One replica (the real scheduler and KV books on a simulated clock) under ``requests``, sent
    at ``offered_rps``. ``windows``: the model's KV cache groups (``kv_groups.group_windows``)."""
    clock = SimClock()
    recorder = _SplitRecorder(model)
    kv = KVCacheManager(num_kv_blocks, block_size, True, num_state_slots, num_checkpoints=num_checkpoints,
                        checkpoint_interval=4 * block_size if num_checkpoints else 0, group_windows=windows,
                        max_chunk_tokens=max_num_batched_tokens)
    sliding = min((w for w in windows if w is not None), default=None)
    core = EngineCore(PlaceholderRunner(clock, recorder, vocab, sliding_window=sliding), kv,
                      SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len), clock=clock)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: dict[int, int] = {}
    done: set[int] = set()
    cached = steps = 0
    i = 0
    while len(done) < len(requests):
        now = clock()
        while i < len(requests) and requests[i].arrival + request_overhead_s <= now:
            r = requests[i]
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True).with_defaults()
            core.add_request(EngineRequest(str(i), r.prompt, params, arrival_time=now))
            i += 1
        if not core.has_unfinished_requests():
            clock.wait_until(requests[i].arrival + request_overhead_s)
            continue
        steps += 1
        for out in core.step():
            k, now = int(out.request_id), clock()
            if out.new_token_ids:
                first.setdefault(k, now)
                last[k] = now
                tokens[k] = out.num_output_tokens
            if out.finished:
                done.add(k)
                cached += out.num_cached_tokens
    span = max(clock() - requests[0].arrival, 1e-9)
    ttft = [first[k] - requests[k].arrival for k in done]
    tpot = [(last[k] - first[k]) / (tokens[k] - 1) for k in done if tokens[k] > 1]
    t, p = stats_ms(ttft), stats_ms(tpot)
    busy = recorder.prefill_s + recorder.decode_s
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return LoadPoint(
        rps=offered_rps,
        served_rps=len(done) / span, requests=len(requests), completed=len(done),
        ttft_p50_ms=t["p50"] or 0.0, ttft_p99_ms=t["p99"] or 0.0,
        tpot_p50_ms=p["p50"] or 0.0, tpot_p99_ms=p["p99"] or 0.0,
        output_tok_s=sum(tokens.values()) / span, input_tok_s=prompt_tokens / span,
        prefill_share=recorder.prefill_s / busy if busy else 0.0, busy_share=min(1.0, recorder.busy_s / span),
        prefix_hit_rate=cached / max(prompt_tokens, 1), steps=steps)


@dataclass(frozen=True)
class Replica:
    """What one replica of ``tp`` GPUs holds: its step model and its KV pool."""

    model: AcceleratorStepModel
    num_kv_blocks: int
    num_state_slots: int
    max_model_len: int
    vocab: int
    request_overhead_s: float
    num_checkpoints: int = 0  # hybrid models' state checkpoints (prefix caching)
    windows: tuple[int | None, ...] = (None,)  # per KV cache group, its sliding window (kv_groups)


def build_replica(config: ModelConfig, cost: AcceleratorCost, machine: Machine, tp: int, max_num_seqs: int,
                  block_size: int = 16, max_model_len: int | None = None) -> Replica | None:
    """None when the weights and one state slot per sequence leave no KV block on ``tp`` GPUs."""
    usable = tp * (machine.memory_gb or 0) * 1e9 * MEMORY_UTILIZATION
    slots = max_num_seqs if config.is_hybrid else 0
    # A hybrid model's prefix caching needs state checkpoints (serve's default: 2 per sequence slot).
    checkpoints = 2 * max_num_seqs if config.is_hybrid else 0
    left = usable - cost.cost.weight_bytes - (slots + checkpoints) * cost.cost.state_bytes_per_sequence
    blocks = int(left // kv_block_bytes(config, cost.cost.kv_bytes_per_token, block_size)) if left > 0 else 0
    if blocks < 1:
        return None
    overhead = (machine.request_overhead_ms or 0.0) / 1e3
    return Replica(AcceleratorStepModel(cost, machine, tp), blocks, slots,
                   min(max_model_len or config.max_position_embeddings, config.max_position_embeddings),
                   config.vocab_size, overhead, checkpoints, tuple(group_windows(config)))


def measure(replica: Replica, forecast: Forecast, rps: float, num_requests: int, max_num_seqs: int,
            max_num_batched_tokens: int, seed: int = 0) -> LoadPoint:
    requests = workload(forecast, rps, num_requests, replica.vocab, replica.max_model_len, seed)
    return run_open_loop(replica.model, requests, replica.num_kv_blocks, max_num_seqs, max_num_batched_tokens,
                         replica.max_model_len, replica.num_state_slots, replica.vocab, replica.request_overhead_s, rps,
                         num_checkpoints=replica.num_checkpoints, windows=replica.windows)


def plan_fleet(config: ModelConfig, model_name: str, machine: Machine, forecast: Forecast, slo: Slo,
               price_per_hour: float | None = None, hosted_price: tuple[float, float] = WORKERS_AI_PRICE,
               headroom: float = 0.2, max_num_seqs_options: tuple[int, ...] = (256,),
               tensor_parallel_size: int | None = None, num_requests: int = 200, sweep_requests: int = 100,
               max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS, seed: int = 0) -> FleetPlan:
    price = price_per_hour if price_per_hour is not None else machine.price_per_hour
    if price is None or price < 0:
        raise PlanError(f"{machine.name} has no price per hour: pass --price-per-hour")
    if not machine.is_accelerator or not machine.memory_gb:
        raise PlanError(f"{machine.name} is not an accelerator of the table (no achieved fractions or memory)")
    if headroom < 0:
        raise PlanError("--headroom must be >= 0")
    cost = accelerator_cost(config, machine.dtype_size)
    longest = forecast.turns * (forecast.input_len + forecast.output_len) * 4
    degrees = (tensor_parallel_size,) if tensor_parallel_size else TP_DEGREES
    candidates: list[Candidate] = []
    smallest = None
    for tp in degrees:
        # The smallest group that holds the model and the next: a latency objective (TTFT of
        # long prompts) can make a wider group cheaper per request than more narrow ones.
        if smallest is not None and tp > 2 * smallest:
            break
        for seqs in max_num_seqs_options:
            replica = build_replica(config, cost, machine, tp, seqs, max_model_len=max(longest, 4096))
            if replica is None:
                continue
            smallest = smallest or tp
            to_beat = min((c.gpu_hours_per_request() for c in candidates), default=math.inf)
            candidates.append(_sweep(replica, forecast, slo, tp, seqs, sweep_requests, max_num_batched_tokens, seed,
                                     to_beat))
    if not candidates:
        raise PlanError(f"{model_name}'s weights ({cost.cost.weight_bytes / 1e9:.0f} GB) leave no KV block on "
                        f"{' or '.join(str(d) for d in degrees)} x {machine.name} ({machine.memory_gb:g} GB each)")
    notes: list[str] = []
    meeting = [c for c in candidates if c.capacity_rps > 0]
    skipped = [c for c in candidates if not c.curve]
    if skipped:
        notes.append("not swept (even saturated, fewer requests per GPU-hour than the chosen setting): "
                     + ", ".join(f"tensor-parallel {c.tp} x max-num-seqs {c.max_num_seqs}" for c in skipped))
    candidates = [c for c in candidates if c.curve]
    if not meeting:
        notes.append("no setting met the SLOs at any load tried: the plan sizes for the lowest load tried")
        for c in candidates:
            c.capacity_rps = c.curve[0].rps
        meeting = candidates
    chosen = min(meeting, key=lambda c: (c.gpu_hours_per_request(), -c.capacity_rps))
    replicas = max(1, math.ceil(forecast.peak_rps * (1 + headroom) / chosen.capacity_rps))
    replica = build_replica(config, cost, machine, chosen.tp, chosen.max_num_seqs, max_model_len=max(longest, 4096))
    assert replica is not None
    peak = measure(replica, forecast, forecast.peak_rps / replicas, num_requests, chosen.max_num_seqs,
                   max_num_batched_tokens, seed)
    low = min(forecast.daily_curve) * forecast.peak_rps
    off_replicas = max(1, math.ceil(low * (1 + headroom) / chosen.capacity_rps))
    off_peak = measure(replica, forecast, low / off_replicas, num_requests, chosen.max_num_seqs,
                       max_num_batched_tokens, seed)
    hourly = [max(1, math.ceil(f * forecast.peak_rps * (1 + headroom) / chosen.capacity_rps))
              for f in forecast.daily_curve]
    daily_cost = sum(hourly) * chosen.tp * price
    requests_per_day = sum(f * forecast.peak_rps * 3600 for f in forecast.daily_curve)
    mean_in, mean_out = peak.input_tok_s / max(peak.rps, 1e-9), peak.output_tok_s / max(peak.rps, 1e-9)
    in_tokens, out_tokens = requests_per_day * mean_in, requests_per_day * mean_out
    cost_in = daily_cost * peak.prefill_share / max(in_tokens / 1e6, 1e-9)
    cost_out = daily_cost * (1 - peak.prefill_share) / max(out_tokens / 1e6, 1e-9)
    hosted_daily = in_tokens / 1e6 * hosted_price[0] + out_tokens / 1e6 * hosted_price[1]
    if peak.prefix_hit_rate > 0:
        notes.append(f"{peak.prefix_hit_rate:.0%} of prompt tokens came from the prefix cache at the peak "
                     "(the hosted price bills them all)")
    notes.append("step times from the accelerator step model (docs/operate/planner.md): bf16 weights and KV, vLLM-class "
                 "GPU kernels; prices per GPU-hour are assumptions unless --price-per-hour is given")
    return FleetPlan(
        model=model_name, accelerator=machine.name, price_per_hour=price, forecast=forecast, slo=slo,
        chosen=chosen, candidates=candidates, replicas=replicas,
        headroom=replicas * chosen.capacity_rps / forecast.peak_rps - 1,
        max_num_batched_tokens=max_num_batched_tokens, block_size=16, peak=peak, off_peak=off_peak,
        off_peak_replicas=off_replicas, hourly_replicas=hourly, daily_cost=daily_cost,
        cost_per_m_input=cost_in, cost_per_m_output=cost_out, hosted_price=hosted_price,
        hosted_daily_cost=hosted_daily, weights_gb=cost.cost.weight_bytes / 1e9, notes=notes,
        simulated_steps=sum(c.steps for c in candidates + skipped) + peak.steps + off_peak.steps)


def _sweep(replica: Replica, forecast: Forecast, slo: Slo, tp: int, max_num_seqs: int, num_requests: int,
           max_num_batched_tokens: int, seed: int, to_beat: float = math.inf) -> Candidate:
    """The saturated rate (every request at once), then open-loop loads at fractions of it.
    ``to_beat``: GPU-hours per request of a setting already swept; a setting that needs more even
    at its saturated rate (which bounds its capacity) can never be chosen and gets no curve."""
    burst = measure(replica, forecast, 1e6, num_requests, max_num_seqs, max_num_batched_tokens, seed)
    saturated = burst.served_rps
    if saturated <= 0 or tp / (saturated * 3600) > to_beat:
        return Candidate(tp, max_num_seqs, replica.num_kv_blocks, saturated, [], 0.0, burst.steps)
    curve = [measure(replica, forecast, f * saturated, num_requests, max_num_seqs, max_num_batched_tokens, seed)
             for f in LOAD_FRACTIONS]
    # A short open-loop run at an offered rate above saturation has not yet built its queue: a
    # replica's capacity is never more than what it served with every request at once.
    capacity = min(max((p.rps for p in curve if slo.met(p)), default=0.0), saturated)
    return Candidate(tp, max_num_seqs, replica.num_kv_blocks, saturated, curve, capacity,
                     burst.steps + sum(p.steps for p in curve))

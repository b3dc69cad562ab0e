"""``tokenline simulate``: the real Scheduler and KVCacheManager, through ``EngineCore``, on a
simulated clock, loaded by a closed-loop client like ``tokenline bench serve``'s; the report has
the same fields as ``bench serve --output-json``, so the two compare field by field.

The same closed loop drives a real engine on the wall clock (``run_closed_loop``), which is how the
tests hold a simulation against a real run.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenline.bench.prompts import make_prompts
from tokenline.bench.results import BenchServeReport, RequestResult, stats_ms
from tokenline.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.sampling_params import SamplingParams
from tokenline.sim.placeholder_runner import PlaceholderRunner, SimClock
from tokenline.sim.profile import Profile
from tokenline.sim.sim_target import SimTarget, WhatIf, resolve_target



@dataclass
class SimConfig:
    concurrency: int = 1
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    max_num_seqs: int = 128
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # the server's default
    kv_cache_memory_gib: float | None = None  # None: the machine's memory less the weights, or 2 GiB here
    block_size: int = 16
    seed: int = 0
    request_overhead_s: float | None = None  # None: the profile's
    # What-ifs: another model (an HF config.json) and/or machine ("this", a shipped name, a JSON file).
    model_config: str | None = None
    machine: str | None = None
    num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if min(self.concurrency, self.num_prompts, self.input_len, self.output_len) < 1:
            raise ValueError("concurrency, num_prompts, input_len and output_len must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.what_if = WhatIf(self.model_config, self.machine, self.kv_cache_memory_gib, self.num_kv_blocks)
        if self.request_overhead_s is not None and self.request_overhead_s < 0:
            raise ValueError("request_overhead must be >= 0")


@dataclass
class ClosedLoopRun:
    results: list[RequestResult]
    duration_s: float
    max_in_flight: int


def run_closed_loop(
    core: EngineCore,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    request_overhead_s: float = 0.0,
    wait_until: Callable[[float], None] | None = None,
    api_contention: float = 1.0,
) -> ClosedLoopRun:
    """Keep ``concurrency`` requests in flight until every prompt has had ``output_len`` tokens.

    A request reaches the engine ``request_overhead_s`` after its client sends it (the HTTP and
    tokenize path), one at a time: the API process takes requests sent together in turn, so the
    first reaches an idle engine alone and starts a step by itself, as in a real server. TTFT and
    E2E count from the send. Times come from ``core.clock``; ``wait_until`` passes idle time
    (default: sleep on the wall clock). ``api_contention``: how many times slower a step runs while
    the API process works beside it (``api_contention_factor``); the step is stretched by the
    overlap."""
    clock = core.clock
    wait = wait_until or (lambda t: time.sleep(max(0.0, t - clock())))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True).with_defaults()
    results = [RequestResult(prompt_len=len(p)) for p in prompts]
    sent = [0.0] * len(prompts)
    last = [0.0] * len(prompts)
    arrivals: list[tuple[float, int]] = []
    next_index = in_flight = max_in_flight = finished = 0
    api_free_at = clock()  # when the API process is done with the requests handed to it so far

    def send(now: float) -> None:
        nonlocal next_index, in_flight, max_in_flight, api_free_at
        sent[next_index] = now
        api_free_at = max(now, api_free_at) + request_overhead_s
        heapq.heappush(arrivals, (api_free_at, next_index))
        next_index += 1
        in_flight += 1
        max_in_flight = max(max_in_flight, in_flight)

    start = clock()
    while next_index < min(concurrency, len(prompts)):
        send(start)
    while finished < len(prompts):
        now = clock()
        while arrivals and arrivals[0][0] <= now:
            _, i = heapq.heappop(arrivals)
            core.add_request(EngineRequest(str(i), prompts[i], params, arrival_time=now))
        if not core.has_unfinished_requests():
            wait(arrivals[0][0])  # nothing to run until the next request lands
            continue
        began = clock()
        outputs = core.step()
        now = clock()
        if api_contention > 1.0 and api_free_at > began:  # the API took a core for part of the step
            busy = api_free_at - began
            wait(now + min((now - began) * (api_contention - 1.0), busy * (1.0 - 1.0 / api_contention)))
            now = clock()
        for out in outputs:
            i = int(out.request_id)
            r = results[i]
            if out.new_token_ids:
                if r.ttft is None:
                    r.ttft = now - sent[i]
                else:
                    r.itl.append(now - last[i])
                last[i] = now
            if out.finished:
                r.e2e = now - sent[i]
                r.output_tokens = out.num_output_tokens
                r.usage_reported = r.success = True
                finished += 1
                in_flight -= 1
                if next_index < len(prompts):
                    send(now)
    return ClosedLoopRun(results, clock() - start, max_in_flight)


def sim_target(profile: Profile, config: SimConfig) -> SimTarget:
    return resolve_target(profile, config.what_if, config.max_num_seqs, config.block_size)


def build_sim_core(target: SimTarget, config: SimConfig, clock: SimClock, kv_events: bool = False,
                   filler_token_id: int | None = None) -> EngineCore:
    """An EngineCore with the real scheduler and KV books, a pool of the target's blocks (and state
    slots, for a hybrid model), and the placeholder runner (sampling ``filler_token_id`` where given,
    see PlaceholderRunner). A fleet would build one per replica."""
    kv_cache = KVCacheManager(target.num_kv_blocks, config.block_size, True, target.num_state_slots, kv_events,
                              group_windows=target.windows, max_chunk_tokens=config.max_num_batched_tokens)
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=target.max_model_len,
    )
    runner = PlaceholderRunner(clock, target.step_model, target.vocab_size, step_overhead_s=target.step_overhead_s,
                               filler_token_id=filler_token_id, sliding_window=target.sliding_window)
    return EngineCore(runner, kv_cache, scheduler_config, clock=clock)


def report(run: ClosedLoopRun, config: SimConfig, model: str, base_url: str) -> BenchServeReport:
    """``bench serve``'s report of a closed-loop run."""
    ok = [r for r in run.results if r.success]
    return BenchServeReport(
        base_url=base_url,
        endpoint="completions",
        model=model,
        concurrency=config.concurrency,
        num_prompts=config.num_prompts,
        input_len=config.input_len,
        output_len=config.output_len,
        seed=config.seed,
        shared_prefix_len=0,
        input_len_exact=True,
        completed=len(ok),
        failed=len(run.results) - len(ok),
        errors={},
        duration_s=run.duration_s,
        total_input_tokens=sum(r.prompt_len for r in ok),
        total_output_tokens=sum(r.output_tokens for r in ok),
        max_in_flight=run.max_in_flight,
        usage_reported=sum(r.usage_reported for r in ok),
        ttft_ms=stats_ms([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=stats_ms([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=stats_ms([x for r in ok for x in r.itl]),
        e2e_ms=stats_ms([r.e2e for r in ok]),
    )


def workload_prompts(config: SimConfig, vocab_size: int) -> list[list[int]]:
    """Seeded random prompts of exactly ``input_len`` ids, like ``bench serve``'s."""
    return make_prompts(config.num_prompts, config.input_len, range(vocab_size), config.seed)


def request_overhead(profile: Profile, config: SimConfig, target: SimTarget) -> float:
    """The flag's, else the target machine's own (an accelerator's), else the profile's."""
    if config.request_overhead_s is not None:
        return config.request_overhead_s
    return profile.request_overhead_s if target.request_overhead_s is None else target.request_overhead_s


def api_contention_factor(profile: Profile, config: SimConfig) -> float:
    """How many times slower a step runs while the API process works: 2 on the calibrated CPU itself
    (no ``--machine``) when the engine's threads take every core, else 1. An OpenMP step waits for
    its slowest thread, and the one whose core the API process shares runs at half speed: a real
    server's first step of a 16-request wave (one 64-token prompt) took 2 x its offline time while
    the other 15 requests were handed over, and they all waited for the next step."""
    machine = profile.machine
    if config.what_if.machine not in (None, "this") or machine.get("device", "cpu") != "cpu":
        return 1.0
    threads, cpus = machine.get("torch_threads"), machine.get("cpu_count")
    return 2.0 if isinstance(threads, int) and isinstance(cpus, int) and threads >= cpus else 1.0


def simulate(profile: Profile, config: SimConfig, target: SimTarget | None = None) -> BenchServeReport:
    """Run the workload on simulated time and report it as ``bench serve`` would."""
    target = target or sim_target(profile, config)
    clock = SimClock()
    core = build_sim_core(target, config, clock)
    overhead = request_overhead(profile, config, target)
    prompts = workload_prompts(config, target.vocab_size)
    run = run_closed_loop(core, prompts, config.output_len, config.concurrency, overhead, clock.wait_until,
                          api_contention_factor(profile, config))
    return report(run, config, target.model, "simulated")

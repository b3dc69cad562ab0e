"""``tokenline bench calibrate``: run the real engine offline over a small designed set of batches
and fit the step-time model to its own step records.

The design: single prompts of a few sizes (pure prefill steps), follow-up prompts that extend one
of those by a few dozen tokens (a prefill over a cached prefix, as a chat's next turn), then a few
decode batch sizes at a few context lengths (a prefill step or two, then pure decode steps). Every
other prompt is random, so the prefix cache serves the follow-ups alone.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenline.engine.config import EngineConfig

from tokenline.engine.factory import build_engine_core
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.messages import EngineRequest
from tokenline.model.batch import SampledToken, ScheduledBatch
from tokenline.model.config import ModelConfig
from tokenline.sampling_params import SamplingParams
from tokenline.sim.calibration_load import LoadPolicy, LoadWatch
from tokenline.sim.profile import Profile
from tokenline.sim.server_fit import run_server_loads
from tokenline.sim.step_model import StepFeatures, batch_features, fit_step_model


@dataclass
class CalibrationDesign:
    # 64 against 72 and 96, either side of the one-call layer's cap (FUSED_DECODE_ROWS), pin its jump
    # (f): with 96 alone it came out 12.6, 27.2 and 16.1 ms in three quiet calibrations, and the two
    # smaller put a server's c=4 x 64-token TPOT (a prompt beside three decodes: 67 tokens) 23 % low.
    prefill_lens: tuple[int, ...] = (32, 64, 72, 96, 128, 384)
    # 1024 (batches 1-8) pins the cost per attended context token (d) where little else grows: with
    # contexts of 32 and 256 only, d moved between 5 and 13 us from one calibration to the next,
    # and multi-turn chats (contexts of 300-550) read 20-36 % off in TPOT.
    context_lens: tuple[int, ...] = (32, 256, 1024)
    decode_batches: tuple[int, ...] = (1, 4, 8, 16, 32)
    # A decode batch's prompts together at most. 8192 takes batch 32 to 256-token contexts: a server
    # at c=32 decodes there, and a design that stopped at 2048 put those steps 14-25 % too fast.
    max_batch_tokens: int = 8192
    # The design's own step budget, whatever the server's default: its decode batches' prefill steps
    # reach 2048 tokens, so a profile prices the steps of a larger --max-num-batched-tokens too.
    step_tokens: int = 2048
    decode_steps: int = 5  # output tokens per decode-batch request: its prefill step, then decode steps
    repeats: int = 3  # two left the fit's coefficients to each run's noise (profiles 10-25 % apart)
    max_seconds: float = 300.0  # the design stops early (keeping what it has) past this
    # Where a step's prefill tokens may start to cost more each (step_model's prefill hinge): the fit
    # takes the best of these. The decode batches' prefill steps reach 1024 and 2048 tokens.
    prefill_knots: tuple[int, ...] = (512, 1024, 1536)
    # (cached prefix, new tokens): a prefill chunk over a cached prefix, whose attention grows with
    # its tokens times that context. Fresh prompts pin its price (q, q_fused) poorly: their query-key
    # pairs grow as the square of their tokens, as the prefill hinge lets their cost grow too.
    # Without these, multi-turn chats' follow-up prefills ran ~15 % slower than the fit priced them.
    followups: tuple[tuple[int, int], ...] = ((256, 32), (256, 128), (512, 64), (1024, 32), (1024, 128))


@dataclass
class _FeatureRecorder:
    """Wraps the real runner and notes the features of every batch it runs, in step order."""

    runner: object
    features: list[StepFeatures] = field(default_factory=list)

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        self.features.append(batch_features(batch))
        return self.runner.execute(batch)  # type: ignore[attr-defined]


def _run(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True).with_defaults()
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"cal-{time.monotonic_ns()}-{i}", prompt, params))
    while core.has_unfinished_requests():
        core.step()


def machine_info(device: str) -> dict[str, object]:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }


def measure_roofline(dtype: object, bandwidth_bytes: int = 512 << 20, matmul_size: int = 1024) -> dict[str, float]:
    """This machine's memory bandwidth and matmul peak at ``dtype``, with the threads the fit ran on:
    the denominators of the what-ifs' roofline ratio (a few seconds; ``bench roofline`` measures longer)."""
    from tokenline.bench.machine_probes import measure_bandwidth, measure_matmul_gflops

    return {
        "memory_bandwidth_gbps": measure_bandwidth(bandwidth_bytes, repeats=3).gb_per_s,
        "matmul_gflops": measure_matmul_gflops(dtype, matmul_size, repeats=3),  # type: ignore[arg-type]
    }


def calibrate(
    model_dir: Path,
    dtype: str = "auto",
    device: str = "cpu",
    design: CalibrationDesign | None = None,
    request_overhead_s: float | None = None,
    threads: int | None = None,
    server_run: bool = False,
    load_policy: LoadPolicy | None = None,
) -> Profile:
    """Fit a step-time profile of ``model_dir`` on this machine (with ``threads`` torch threads,
    as the server would be started with; None: torch's default). ``server_run``: also fit what a
    real server adds per step and per request (``server_fit``); ``request_overhead_s`` (when not
    None) overrides the measured per-request figure (0 without a server run). ``load_policy``: how
    much CPU neighbours may take before a stretch of runs is repeated or the calibration refused
    (``CalibrationUnderLoad``); the load seen goes into the profile."""
    import torch

    design = design or CalibrationDesign()
    # First, before minutes of loading and warming up: a busy machine is refused in seconds.
    watch = LoadWatch(load_policy or LoadPolicy())
    watch.wait_for_quiet()
    if threads is not None:
        torch.set_num_threads(threads)
    model_config = ModelConfig.from_dir(model_dir)
    longest = max(max(design.prefill_lens), max(design.context_lens) + design.decode_steps,
                  max((cached + new + 1 for cached, new in design.followups), default=0))
    # Room for the largest decode batch at once (max_batch_tokens at float32's 46 KB a token on the
    # default model: 0.25 GiB held 22 of batch 32's 256-token sequences).
    config = EngineConfig(
        dtype=dtype, device=device, enable_prefix_caching=True, kv_cache_memory_gib=0.5,
        max_model_len=min(model_config.max_position_embeddings, max(longest, 1024)),
        max_num_batched_tokens=design.step_tokens,
    )
    core = build_engine_core(config, model_dir)
    runner = core.runner
    recorder = _FeatureRecorder(runner)
    core.runner = recorder  # type: ignore[assignment]
    vocab = runner.sampler.vocab_size
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]

    _run(core, prompts(1, 16), 4)  # warm-up: first-call costs are not step time
    core.take_step_records()
    recorder.features.clear()
    deadline = [time.monotonic() + design.max_seconds]  # moved on by the time of discarded stretches
    # (batch, prompt length, tokens, cached prefix): pure prefills, follow-ups, then decode batches.
    # Each repeat in its own shuffled order, so a load that rises or falls on a shared machine biases
    # no one coefficient.
    runs = [(1, length, 1, 0) for length in design.prefill_lens] + [
        (1, new, 1, cached) for cached, new in design.followups] + [
        (batch, context, design.decode_steps, 0) for context in design.context_lens
        for batch in design.decode_batches if batch * context <= design.max_batch_tokens]

    def item(batch: int, length: int, tokens: int, cached: int) -> Callable[[], None]:
        def run() -> None:
            if cached:
                if time.monotonic() < deadline[0]:  # the prefix's own prefill, then the follow-up over it
                    prefix = prompts(1, cached)
                    _run(core, prefix, 1)
                    _run(core, [prefix[0] + prompts(1, length)[0]], 1)
            elif tokens == 1 or time.monotonic() < deadline[0]:
                _run(core, prompts(batch, length), tokens)
        return run

    records: list = []

    def begin() -> tuple[int, int, float]:
        records.extend(core.take_step_records())
        return len(recorder.features), len(records), time.monotonic()

    def discard(mark: tuple[int, int, float]) -> None:  # a loaded stretch's steps, before it runs again
        core.take_step_records()
        del recorder.features[mark[0]:]
        del records[mark[1]:]
        deadline[0] += time.monotonic() - mark[2]  # a repeat does not eat the design's later runs

    items = [item(*run) for _ in range(design.repeats) for run in rng.sample(runs, len(runs))]
    watch.run_stretches(items, begin, discard)
    records.extend(core.take_step_records())
    if len(records) != len(recorder.features):
        raise RuntimeError(f"{len(records)} step records for {len(recorder.features)} batches")
    features, durations = list(recorder.features), [r.duration for r in records]
    # The decode curve may bend at each inner batch size of the design (step_model's hinges).
    batches = design.decode_batches
    knots = tuple(sorted(b for b in set(batches) if min(batches) < b < max(batches)))
    step_model = fit_step_model(features, durations, knots, design.prefill_knots)
    # Every attention layer's KV of one token (a pool block holds one KV cache group's: kv_block_bytes).
    kv_bytes_per_token = type(runner.model).kv_bytes_per_token(model_config, runner.kv_dtype.itemsize)
    machine = machine_info(device)
    machine.update(measure_roofline(runner.dtype))
    dtype_name = str(runner.dtype).removeprefix("torch.")
    fit = None
    if server_run:
        del core, runner, recorder  # the server loads its own copy of the model
        server = run_server_loads(model_dir, dtype_name, torch.get_num_threads(), judge_load=watch.judge_server)
        # One model over both: the offline design pins prefill and small batches, the server's busy
        # steps the decode batches and contexts a server runs (an offline-only fit put batch-8 steps
        # 15 % high against a real server's, its context cost taken from contexts of 32-256).
        step_model = fit_step_model(features + [f for f, _ in server.steps],
                                    durations + [w for _, w in server.steps], knots, design.prefill_knots,
                                    in_server=[False] * len(features) + [True] * len(server.steps))
        # k stays 1: this model's fit holds the server's steps already, and a scale fitted again on
        # them alone weighed the machine's speed in their ~90 s. Six calibrations here fitted k =
        # 0.95-1.05; the comparisons straight after each stepped at a median 0.99-1.04 of the model.
        fit = server.fit(step_model, scale=False)
    return Profile(
        step_model=step_model,
        model=model_dir.name,
        dtype=dtype_name,
        machine=machine,
        vocab_size=vocab,
        max_model_len=model_config.max_position_embeddings,
        kv_bytes_per_token=kv_bytes_per_token,
        request_overhead_s=request_overhead_s if request_overhead_s is not None else
        (fit.request_overhead_s if fit else 0.0),
        num_steps=len(records) + (fit.num_steps if fit else 0),
        step_overhead_s=fit.step_overhead_s if fit else 0.0,
        step_overhead_per_seq_s=fit.step_overhead_per_seq_s if fit else 0.0,
        step_scale=fit.step_scale if fit else 1.0,
        server_steps=fit.num_steps if fit else 0,
        model_config=json.loads((model_dir / "config.json").read_text()),
        load=watch.load.to_dict(),
        max_num_batched_tokens=design.step_tokens,
    )

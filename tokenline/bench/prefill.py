"""How close chunked prefill is to this machine's matmul peak: ``tokenline bench prefill``.

A prompt of ``prompt_len`` tokens whose first ``cached_prefix`` an earlier request left in the
prefix cache is prefilled in chunks of the engine's token budget, through the real
``EngineCore.step``. Timers on the model's modules (forward hooks) split each step into the decoder
layers' linears (their FLOPs counted from the calls themselves: 2 x rows x in x out), the attention
(the attention modules' time less their two projections: RoPE, the K/V write and the causal
attention over the paged cache, prefix included) and the rest (norms, activations, the head, the
runner). A step small enough for the one-call decode layer (``DecoderLM.fused_step_tokens``, a
short last chunk) is timed whole only. The linears' FLOP/s is set against the bfloat16 matmul peak
that ``machine_probes`` measures (an n x n x n ``torch.mm``), whatever the weights' format: the
question is how much of the machine's matmul rate a prefill gets. ``clock="cpu"`` (one torch thread)
times the peak and every part by this thread's CPU time, so neighbours on a shared machine do not
count (the engine runs in this process, its kernels on this thread).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenline.bench.machine_probes import GB, measure_matmul_gflops
from tokenline.bench.roofline import cpu_sample, others_cpu_share
from tokenline.bench.throughput import synthetic_prompts


@dataclass
class PrefillConfig:
    model: str | None = None  # directory or .gguf; None: the default model
    dtype: str = "bfloat16"
    quantization: str | None = None  # q8_0 / q4_1: the linears held in ggml's blocks
    prompt_len: int = 2048  # the whole prompt, cached prefix included
    cached_prefix: int = 512  # its first tokens, which an earlier request left in the prefix cache
    chunk: int | None = None  # the engine's token budget a step (None: its default)
    repeats: int = 3  # timed prefills (fresh tokens each, the same cached prefix)
    matmul_size: int = 2048
    seed: int = 0
    clock: str = "wall"  # or "cpu": this thread's CPU time (with one torch thread)

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        if self.prompt_len < 1 or self.repeats < 1 or self.matmul_size < 1:
            raise ValueError("prompt_len, repeats and matmul_size must be positive")
        if not 0 <= self.cached_prefix < self.prompt_len:
            raise ValueError("cached_prefix must be at least 0 and shorter than prompt_len")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError("chunk must be positive")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")


@dataclass
class PartTimes:
    """Seconds of one step (or a sum of steps) by part, and the linears' FLOPs."""

    linear_s: float = 0.0
    linear_flops: int = 0
    attention_s: float = 0.0  # the attention modules less their projections
    step_s: float = 0.0

    def add(self, other: PartTimes) -> None:
        self.linear_s += other.linear_s
        self.linear_flops += other.linear_flops
        self.attention_s += other.attention_s
        self.step_s += other.step_s

    @property
    def linear_gflops(self) -> float:
        return self.linear_flops / self.linear_s / GB if self.linear_s else 0.0

    @property
    def attention_over_linears(self) -> float:
        return self.attention_s / self.linear_s if self.linear_s else math.inf


@dataclass
class ChunkTiming:
    tokens: int  # rows of the step
    context_len: int  # keys the chunk's last token sees
    parts: PartTimes


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


class _StepTimers:
    """Forward hooks timing the decoder layers' linears and the attention modules of a model. The
    linears' hooks add to the attention module's inner time while one is open, so its own time is
    what is left. CPU work is synchronous, so wall clock around a module is its time."""

    def __init__(self, model: nn.Module, clock: Callable[[], float]) -> None:
        from tokenline.model.layers import Attention

        self.clock = clock
        self.parts = PartTimes()
        self._open: dict[int, float] = {}
        self._inner_s = 0.0
        self._attention_depth = 0
        self._handles: list[Any] = []
        head = getattr(model, "lm_head", None)
        for module in model.modules():
            if isinstance(module, Attention):
                self._hook(module, self._attention_pre, self._attention_post)
            elif isinstance(module, nn.Linear) and module is not head:
                self._hook(module, self._linear_pre, self._linear_post)

    def _hook(self, module: nn.Module, pre: Callable[..., None], post: Callable[..., None]) -> None:
        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _linear_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._open[id(module)] = self.clock()

    def _linear_post(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        seconds = self.clock() - self._open.pop(id(module))
        self.parts.linear_s += seconds
        assert isinstance(module, nn.Linear)
        rows = args[0].numel() // module.in_features
        self.parts.linear_flops += 2 * rows * module.in_features * module.out_features
        if self._attention_depth:
            self._inner_s += seconds

    def _attention_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._open[id(module)] = self.clock()
        self._attention_depth += 1
        self._inner_s = 0.0

    def _attention_post(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        self._attention_depth -= 1
        self.parts.attention_s += self.clock() - self._open.pop(id(module)) - self._inner_s

    def take(self) -> PartTimes:
        parts, self.parts = self.parts, PartTimes()
        return parts

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class PrefillReport:
    model: str
    dtype: str
    quantization: str | None
    prompt_len: int
    cached_prefix: int
    chunk: int
    torch_threads: int
    clock: str
    matmul_gflops_bf16: float
    matmul_size: int
    load_avg_1m: float
    others_cpu_share: float | None  # other processes' share of the CPU during the timed prefills
    runs: list[list[ChunkTiming]] = field(default_factory=list)  # per repeat, its steps

    def median_run(self) -> list[ChunkTiming]:
        """The repeat whose total step time is the median one."""
        ranked = sorted(self.runs, key=lambda run: sum(c.parts.step_s for c in run))
        return ranked[len(ranked) // 2]

    def totals(self, run: list[ChunkTiming]) -> PartTimes:
        total = PartTimes()
        for chunk in run:
            total.add(chunk.parts)
        return total

    def to_dict(self) -> dict[str, Any]:
        head = {k: v for k, v in asdict(self).items() if k != "runs"}
        total = self.totals(self.median_run())
        return {
            **head,
            "median": {**asdict(total), "linear_gflops": total.linear_gflops,
                       "linear_share_of_peak": total.linear_gflops / self.matmul_gflops_bf16,
                       "attention_over_linears": total.attention_over_linears,
                       "new_tokens_per_s": (self.prompt_len - self.cached_prefix) / total.step_s},
            "runs": [[{"tokens": c.tokens, "context_len": c.context_len, **asdict(c.parts)} for c in run]
                     for run in self.runs],
        }

    def format_table(self) -> str:
        run = self.median_run()
        total = self.totals(run)
        peak = self.matmul_gflops_bf16
        quant = f", -q {self.quantization}" if self.quantization else ""
        others = "n/a" if self.others_cpu_share is None else f"{self.others_cpu_share:.0%}"
        lines = [
            f"machine: {self.torch_threads} torch threads, {self.clock} clock, load average {self.load_avg_1m:.2f} before, other "
            f"processes {others} of the CPU while timing; bfloat16 matmul peak ({self.matmul_size}^3 mm) {peak:.0f} GFLOP/s",
            f"model: {self.model} ({self.dtype}{quant}); a {self.prompt_len}-token prompt, its first "
            f"{self.cached_prefix} in the prefix cache, in chunks of {self.chunk}; the median of {len(self.runs)} prefills",
            "",
            "| step | tokens | context | step ms | linears ms | linears GFLOP/s | of peak | attention ms "
            "| attention / linears | rest ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = [(str(i + 1), c.tokens, c.context_len, c.parts) for i, c in enumerate(run)]
        rows.append(("all", sum(c.tokens for c in run), run[-1].context_len if run else 0, total))
        for name, tokens, context, p in rows:
            rest = p.step_s - p.linear_s - p.attention_s
            lines.append(
                f"| {name} | {tokens} | {context} | {p.step_s * 1e3:.1f} | {p.linear_s * 1e3:.1f} "
                f"| {p.linear_gflops:.0f} | {p.linear_gflops / peak:.0%} | {p.attention_s * 1e3:.1f} "
                f"| {p.attention_over_linears:.2f} | {rest * 1e3:.1f} |"
            )
        lines.append("")
        if any(c.tokens and not c.parts.linear_flops for c in run):
            lines.append("(a step without linears ran the one-call decode layer, which these timers do not split)")
        lines.append(f"prefill: {(self.prompt_len - self.cached_prefix) / total.step_s:.0f} new prompt tokens/s")
        return "\n".join(lines)


def run_prefill(config: PrefillConfig, log: Callable[[str], None] = lambda _: None) -> PrefillReport:
    """Measure the bfloat16 matmul peak, load the engine, prefill the cached prefix once, then time
    one untimed and ``repeats`` timed prefills of fresh tokens after it."""
    from tokenline.engine.config import EngineConfig
    from tokenline.engine.factory import build_engine_core
    from tokenline.engine.messages import EngineRequest
    from tokenline.frontend.tokenizer import Tokenizer
    from tokenline.sampling_params import SamplingParams
    from tokenline.store.model_store import resolve_model

    config.validate()
    model_dir = resolve_model(config.model)
    load = os.getloadavg()[0]
    log(f"measuring the bfloat16 matmul peak ({config.matmul_size}^3)")
    clock = CLOCKS[config.clock]
    peak = measure_matmul_gflops(torch.bfloat16, config.matmul_size, clock=clock)
    chunk = config.chunk or EngineConfig().max_num_batched_tokens
    block_size = EngineConfig().block_size
    longest = config.prompt_len + 1
    engine_config = EngineConfig(
        dtype=config.dtype, quantization=config.quantization, enable_prefix_caching=True, max_num_seqs=1,
        max_num_batched_tokens=chunk, max_model_len=longest + 1,
        # the prefix's blocks stay cached beside one prompt's at a time, with room to spare
        num_kv_blocks=2 * (math.ceil(longest / block_size) + 1),
    )
    log(f"loading {model_dir}")
    core = build_engine_core(engine_config, model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    special = set(tokenizer.all_special_ids)
    prompts = synthetic_prompts(config.repeats + 2, config.prompt_len, tokenizer.vocab_size, special, config.seed)
    prefix = prompts[0][: config.cached_prefix]
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True).with_defaults()
    timers = _StepTimers(core.runner.model, clock)
    report = PrefillReport(
        model=str(model_dir), dtype=config.dtype, quantization=config.quantization, prompt_len=config.prompt_len,
        cached_prefix=config.cached_prefix, chunk=chunk, torch_threads=torch.get_num_threads(), clock=config.clock,
        matmul_gflops_bf16=peak, matmul_size=config.matmul_size, load_avg_1m=load, others_cpu_share=None,
    )

    def prefill(request_id: str, tokens: list[int]) -> tuple[list[ChunkTiming], int]:
        """The request's steps, and the prompt tokens the prefix cache gave it."""
        core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=tokens, sampling=sampling))
        core.take_step_records()
        steps: list[tuple[int, PartTimes]] = []
        for _ in range(math.ceil(len(tokens) / chunk) + 2):
            timers.take()
            start = clock()
            outputs = core.step()
            parts = timers.take()
            parts.step_s = clock() - start
            steps.append((sum(r.num_prefill_tokens for r in core.take_step_records()), parts))
            finished = [o for o in outputs if o.request_id == request_id and o.finish_reason is not None]
            if finished:
                context = cached = finished[0].num_cached_tokens
                timings = []
                for rows, step_parts in steps:
                    context += rows
                    timings.append(ChunkTiming(rows, context, step_parts))
                return timings, cached
        raise RuntimeError(f"{request_id}: the prefill did not finish in {len(steps)} steps")

    try:
        if prefix:
            log(f"prefilling the {len(prefix)}-token prefix")
            prefill("prefill-prefix", prefix)
        start_cpu = cpu_sample()
        for i, fresh in enumerate(prompts[1:]):
            tokens = prefix + fresh[len(prefix):]
            run, cached = prefill(f"prefill-{i}", tokens)
            if cached < len(prefix) // block_size * block_size:
                raise RuntimeError(f"the prefix cache gave {cached} of the prefix's {len(prefix)} tokens")
            if i:  # the first is a warm-up (first-touch of the pool, lazy kernel builds)
                report.runs.append(run)
                log(f"prefill {i}: {sum(c.parts.step_s for c in run) * 1e3:.0f} ms")
        report.others_cpu_share = others_cpu_share(start_cpu, cpu_sample())
    finally:
        timers.remove()
    return report


def write_json(report: PrefillReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_dict(), indent=2))


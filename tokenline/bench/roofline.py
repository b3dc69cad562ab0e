"""How far the decode step is from this machine's limits (a roofline).

Measures the machine (memory read bandwidth, matmul peak per dtype), counts what one decode step
must read (weights, KV cache) and compute (FLOPs), times tokenline's real ``EngineCore.step`` at a
few batch sizes, and reports measured time against the lower bound
``max(bytes / bandwidth, FLOPs / peak)``.

The counting and the bound are pure functions over dataclasses (unit-tested); the measuring
functions touch torch and the engine.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenline.bench.machine_probes import GB, BandwidthResult, measure_bandwidth, measure_matmul_gflops
from tokenline.bench.results import percentile
from tokenline.bench.throughput import synthetic_prompts
from tokenline.model.config import ModelConfig
from tokenline.model.loader import model_class

if TYPE_CHECKING:
    from tokenline.engine.engine_core import EngineCore



# --- what one decode step must read and compute -------------------------------------------------


@dataclass(frozen=True)
class MatmulParams:
    """Parameters of the matmuls one decoded token goes through: every linear layer, plus lm_head.

    With tied embeddings lm_head *is* the embedding matrix: it is counted once, here, and the
    embedding lookup (B rows) is not counted at all. Untied, the embedding is ignored likewise."""

    layer_params: int  # linear layers of the decoder blocks (weights and biases)
    lm_head_params: int
    tied_embeddings: bool

    @property
    def total(self) -> int:
        return self.layer_params + self.lm_head_params


@dataclass(frozen=True)
class DecodeCost:
    """What one decode step of ``batch_size`` sequences at ``context_len`` tokens reads and computes."""

    batch_size: int
    context_len: int
    weight_bytes: int  # read once per step whatever the batch size
    kv_bytes: int  # K and V of every cached token of every sequence (attention reads them all)
    state_bytes: int  # recurrent state of linear-attention layers (0 for pure-attention models)
    flops_per_token: int

    @property
    def flops(self) -> int:
        return self.batch_size * self.flops_per_token


@dataclass(frozen=True)
class Bound:
    """Lower bound on a step's time: it cannot move its bytes faster than the memory bandwidth nor
    do its FLOPs faster than the matmul peak; whichever takes longer is the limit."""

    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def limit(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def matmul_params_from_config(config: ModelConfig) -> MatmulParams:
    """Matmul parameters of a pure full-attention model (Llama, Qwen3) from its config alone."""
    if config.is_hybrid:
        raise ValueError("hybrid models: count the loaded model's parameters (matmul_params_from_model)")
    h, i = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    attention = h * (q_size + 2 * kv_size) + q_size * h  # qkv_proj + o_proj
    if config.attention_bias:
        attention += q_size + 2 * kv_size + h
    mlp = h * 2 * i + i * h  # gate_up_proj + down_proj
    if config.mlp_bias:
        mlp += 2 * i + h
    return MatmulParams(
        layer_params=config.num_hidden_layers * (attention + mlp),
        lm_head_params=config.vocab_size * h,
        tied_embeddings=config.tie_word_embeddings,
    )


def matmul_params_from_model(model: nn.Module) -> MatmulParams:
    """Matmul parameters of a loaded model: every ``nn.Linear`` (works for any architecture). A
    tensor shared by two modules is counted once; embeddings are not linear layers, so a tied
    embedding is counted once through lm_head and an untied one not at all."""
    seen: set[int] = set()
    layer_params = lm_head_params = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        # A layer serving from its packed weight alone has no weight parameter (model/layers.py).
        sizes = [(param.data_ptr(), param.numel()) for param in module.parameters(recurse=False)]
        if module.weight is None:
            sizes.append((id(module), module.in_features * module.out_features))
        for key, numel in sizes:
            if key in seen:
                continue
            seen.add(key)
            if name.split(".")[-1] == "lm_head":
                lm_head_params += numel
            else:
                layer_params += numel
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    if embed is None:
        embed = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    tied = lm_head is not None and embed is not None and (
        getattr(embed, "head", [None])[0] is lm_head  # PackedEmbedding: rows of the packed head
        or (lm_head.weight is not None and lm_head.weight.data_ptr() == embed.weight.data_ptr())
    )
    return MatmulParams(layer_params, lm_head_params, tied)


def decode_cost(
    config: ModelConfig,
    params: MatmulParams,
    weight_dtype_size: int,
    kv_dtype_size: int,
    batch_size: int,
    context_len: int,
) -> DecodeCost:
    """Bytes and FLOPs of one decode step. Per token: 2 FLOPs per matmul parameter, plus attention
    over ``context_len`` keys (QK^T and PV: 2 * 2 * context * head_dim per head) per full-attention
    layer. Norms, RoPE, activations and sampling are left out: they are small next to these."""
    attention_flops = 4 * context_len * config.num_attention_heads * config.head_dim * config.num_full_attention_layers
    return DecodeCost(
        batch_size=batch_size,
        context_len=context_len,
        weight_bytes=params.total * weight_dtype_size,
        kv_bytes=batch_size * context_len * config.kv_bytes_per_token(kv_dtype_size),
        state_bytes=batch_size * model_class(config.architecture).state_bytes_per_sequence(config, kv_dtype_size),
        flops_per_token=2 * params.total + attention_flops,
    )


def roofline_bound(num_bytes: float, flops: float, bandwidth_bytes_per_s: float, peak_flops_per_s: float) -> Bound:
    if bandwidth_bytes_per_s <= 0 or peak_flops_per_s <= 0:
        raise ValueError("bandwidth and peak must be positive")
    return Bound(memory_s=num_bytes / bandwidth_bytes_per_s, compute_s=flops / peak_flops_per_s)


# --- measuring the machine ----------------------------------------------------------------------


@dataclass
class MachineInputs:
    bandwidth: BandwidthResult
    matmul_gflops: dict[str, float]  # dtype name -> median GFLOP/s of an n x n x n torch.mm
    matmul_size: int
    torch_threads: int
    torch_version: str
    load_avg_1m: float  # before measuring: other work on the cores skews every figure here
    others_cpu_share: float | None  # CPU other processes took while these were measured


def parse_size(text: str) -> int:
    """``2GiB``, ``64MiB``, ``512M``, ``1e9`` or a plain byte count."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 64MiB, 1000000)")
    number, unit, binary = match.groups()
    scale = (1024 if binary else 1000) ** " KMGT".index(unit or " ")
    return int(float(number) * scale)


@dataclass(frozen=True)
class CpuSample:
    busy_s: float  # CPU time of the whole machine, all processes (from /proc/stat)
    own_s: float  # CPU time of this process, all threads
    wall_s: float


def cpu_sample() -> CpuSample | None:
    """A reading to tell how much CPU other processes took meanwhile; None where /proc/stat is absent."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    return CpuSample(busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter())


def others_cpu_share(start: CpuSample | None, end: CpuSample | None) -> float | None:
    """Fraction of the machine's CPU capacity that other processes used between two samples: on a
    shared host this says whether a figure measured the hardware or the neighbours."""
    if start is None or end is None or end.wall_s <= start.wall_s:
        return None
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return min(1.0, max(0.0, others / ((end.wall_s - start.wall_s) * (os.cpu_count() or 1))))



def measure_machine(bandwidth_bytes: int, repeats: int = 5, matmul_size: int = 2048, seed: int = 0) -> MachineInputs:
    load = os.getloadavg()[0]
    start = cpu_sample()
    bandwidth = measure_bandwidth(bandwidth_bytes, repeats, seed)
    matmul_gflops = {
        name: measure_matmul_gflops(dtype, matmul_size, repeats, seed)
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
    }
    return MachineInputs(
        bandwidth=bandwidth,
        matmul_gflops=matmul_gflops,
        matmul_size=matmul_size,
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        load_avg_1m=load,
        others_cpu_share=others_cpu_share(start, cpu_sample()),
    )


# --- measuring the decode step ------------------------------------------------------------------


def _max_prefill_steps(batch_size: int, prompt_len: int, budget: int) -> int:
    return math.ceil(batch_size * prompt_len / budget) + 2


def decode_max_tokens(batch_size: int, prompt_len: int, budget: int, warmup_steps: int, steps: int) -> int:
    """max_tokens large enough that no sequence finishes before the timed steps end: sequences
    prefilled early already decode while the rest of the batch prefills."""
    return _max_prefill_steps(batch_size, prompt_len, budget) + warmup_steps + steps + 2


@dataclass
class StepTiming:
    batch_size: int
    context_len: float  # mean tokens per sequence attended over during the timed steps
    step_seconds: list[float]
    others_cpu_share: float | None = None  # CPU other processes took during the timed steps

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_seconds)


def _all_prefilled(core: EngineCore, batch_size: int) -> bool:
    running = core.scheduler.running
    return core.scheduler.num_waiting == 0 and len(running) == batch_size and all(
        r.num_output_tokens >= 1 for r in running
    )


def measure_decode_steps(
    core: EngineCore, prompts: Sequence[Sequence[int]], steps: int, warmup_steps: int
) -> StepTiming:
    """Admit the prompts (one sequence each, all of one length), prefill them, warm up, then time
    ``steps`` calls of ``core.step()`` in which every sequence decodes one token. Aborts the
    requests afterwards."""
    from tokenline.engine.messages import EngineRequest
    from tokenline.sampling_params import SamplingParams

    batch_size, prompt_len = len(prompts), len(prompts[0])
    budget = core.scheduler.config.max_num_batched_tokens
    max_prefill_steps = _max_prefill_steps(batch_size, prompt_len, budget)
    max_tokens = decode_max_tokens(batch_size, prompt_len, budget, warmup_steps, steps)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True).with_defaults()
    ids = [f"roofline-b{batch_size}-{i}" for i in range(batch_size)]
    try:
        for request_id, prompt in zip(ids, prompts, strict=True):
            core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=list(prompt), sampling=sampling))
        num_prefill_steps = 0
        while not _all_prefilled(core, batch_size):
            if num_prefill_steps == max_prefill_steps:
                raise RuntimeError(f"batch {batch_size}: not all prompts prefilled after {max_prefill_steps} steps")
            core.step()
            num_prefill_steps += 1
        for _ in range(warmup_steps):
            core.step()
        context_start = statistics.mean(r.num_tokens for r in core.scheduler.running)
        times = []
        start_cpu = cpu_sample()
        for _ in range(steps):
            start = time.perf_counter()
            outputs = core.step()
            times.append(time.perf_counter() - start)
            if len(outputs) != batch_size or any(o.finished for o in outputs):
                raise RuntimeError(f"batch {batch_size}: a timed step did not decode all {batch_size} sequences")
        others = others_cpu_share(start_cpu, cpu_sample())
    finally:
        for request_id in ids:
            core.abort_request(request_id)
    # A decode step at num_tokens = T attends over T keys (the cache plus the new token's).
    return StepTiming(batch_size, context_start + (steps - 1) / 2, times, others)


# --- the report ---------------------------------------------------------------------------------


@dataclass
class RooflineRow:
    batch_size: int
    context_len: float
    step_s_p50: float
    step_s_p10: float
    step_s_p90: float
    others_cpu_share: float | None
    tokens_per_s: float
    cost: DecodeCost
    bound: Bound  # weights only
    bound_with_kv: Bound  # weights + KV (+ recurrent state): attention must read the cache too

    @property
    def ratio(self) -> float:
        return self.step_s_p50 / self.bound.seconds

    @property
    def ratio_with_kv(self) -> float:
        return self.step_s_p50 / self.bound_with_kv.seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "context_len": self.context_len,
            "step_s_p50": self.step_s_p50,
            "step_s_p10": self.step_s_p10,
            "step_s_p90": self.step_s_p90,
            "others_cpu_share": self.others_cpu_share,
            "tokens_per_s": self.tokens_per_s,
            "weight_bytes": self.cost.weight_bytes,
            "kv_bytes": self.cost.kv_bytes,
            "state_bytes": self.cost.state_bytes,
            "flops_per_token": self.cost.flops_per_token,
            "flops": self.cost.flops,
            "bound_s": self.bound.seconds,
            "bound_memory_s": self.bound.memory_s,
            "bound_compute_s": self.bound.compute_s,
            "bound_limit": self.bound.limit,
            "ratio": self.ratio,
            "bound_with_kv_s": self.bound_with_kv.seconds,
            "bound_with_kv_memory_s": self.bound_with_kv.memory_s,
            "bound_with_kv_limit": self.bound_with_kv.limit,
            "ratio_with_kv": self.ratio_with_kv,
        }


def make_row(
    timing: StepTiming,
    config: ModelConfig,
    params: MatmulParams,
    weight_dtype_size: int,
    kv_dtype_size: int,
    bandwidth_gb_per_s: float,
    peak_gflops: float,
) -> RooflineRow:
    context = round(timing.context_len)
    cost = decode_cost(config, params, weight_dtype_size, kv_dtype_size, timing.batch_size, context)
    bandwidth, peak = bandwidth_gb_per_s * GB, peak_gflops * GB
    median = timing.median_s
    return RooflineRow(
        batch_size=timing.batch_size,
        context_len=timing.context_len,
        step_s_p50=median,
        step_s_p10=percentile(timing.step_seconds, 10),
        step_s_p90=percentile(timing.step_seconds, 90),
        others_cpu_share=timing.others_cpu_share,
        tokens_per_s=timing.batch_size / median,
        cost=cost,
        bound=roofline_bound(cost.weight_bytes, cost.flops, bandwidth, peak),
        bound_with_kv=roofline_bound(cost.weight_bytes + cost.kv_bytes + cost.state_bytes, cost.flops, bandwidth, peak),
    )


@dataclass
class RooflineReport:
    model: str
    dtype: str
    prompt_len: int
    steps: int
    machine: MachineInputs
    params: MatmulParams
    kv_bytes_per_token: int
    rows: list[RooflineRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "prompt_len": self.prompt_len,
            "steps": self.steps,
            "machine": asdict(self.machine),
            "model_cost": {
                **asdict(self.params),
                "matmul_params": self.params.total,
                "weight_bytes": self.rows[0].cost.weight_bytes if self.rows else None,
                "kv_bytes_per_token": self.kv_bytes_per_token,
            },
            "rows": [r.to_dict() for r in self.rows],
        }

    def format_table(self) -> str:
        m = self.machine
        bw = m.bandwidth
        others = ", ".join(f"{k} {v:.1f}" for k, v in bw.by_method.items() if k != bw.method)
        lines = [
            f"machine: {m.torch_threads} torch threads (torch {m.torch_version}), load average {m.load_avg_1m:.2f} "
            f"before measuring, other processes used {_share(m.others_cpu_share)} of the CPU while measuring; "
            f"read bandwidth {bw.gb_per_s:.1f} GB/s ({bw.method}; {others}; "
            f"{bw.buffer_bytes / (1 << 30):.2f} GiB buffer, median of {bw.repeats}); "
            f"matmul peak ({m.matmul_size}^3 mm) bfloat16 {m.matmul_gflops['bfloat16']:.0f} GFLOP/s, "
            f"float32 {m.matmul_gflops['float32']:.0f} GFLOP/s",
            f"model: {self.model} ({self.dtype}); weights read per step "
            f"{self.params.total * 1e-6:.1f} M params"
            + (f" = {self.rows[0].cost.weight_bytes / 1e6:.1f} MB" if self.rows else "")
            + f" (lm_head {'tied to' if self.params.tied_embeddings else 'separate from'} the embeddings); "
            f"KV {self.kv_bytes_per_token / 1e3:.1f} kB per token; prompt {self.prompt_len}, {self.steps} timed steps",
            "",
            "| batch | context | step ms p50 (p10-p90) | tok/s | GFLOP/step | bound ms (weights) | limit "
            "| measured/bound | KV MB/step | bound ms (weights+KV) | measured/bound (weights+KV) | others' CPU |",
            "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r.batch_size} | {r.context_len:.0f} "
                f"| {r.step_s_p50 * 1e3:.2f} ({r.step_s_p10 * 1e3:.2f}-{r.step_s_p90 * 1e3:.2f}) "
                f"| {r.tokens_per_s:.1f} | {r.cost.flops / GB:.2f} | {r.bound.seconds * 1e3:.2f} | {r.bound.limit} "
                f"| {r.ratio:.2f}x | {(r.cost.kv_bytes + r.cost.state_bytes) / 1e6:.1f} "
                f"| {r.bound_with_kv.seconds * 1e3:.2f} | {r.ratio_with_kv:.2f}x | {_share(r.others_cpu_share)} |"
            )
        return "\n".join(lines)


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


@dataclass
class RooflineConfig:
    model: str | None = None  # directory or .gguf; None: the default model
    dtype: str = "bfloat16"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompt_len: int = 256
    steps: int = 20
    warmup_steps: int = 3
    bandwidth_bytes: int = 2 << 30
    repeats: int = 5
    matmul_size: int = 2048
    seed: int = 0

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch sizes must be positive")
        if self.prompt_len < 1 or self.steps < 1 or self.warmup_steps < 0 or self.repeats < 1:
            raise ValueError("prompt_len, steps and repeats must be positive, warmup_steps >= 0")


def run_roofline(config: RooflineConfig, log: Callable[[str], None] = lambda _: None) -> RooflineReport:
    """Measure the machine first (its big buffers are freed before the model loads), then load the
    engine once and time each batch size in turn."""
    from tokenline.engine.config import EngineConfig
    from tokenline.engine.factory import build_engine_core
    from tokenline.frontend.tokenizer import Tokenizer
    from tokenline.store.model_store import resolve_model

    config.validate()
    model_dir = resolve_model(config.model)
    log(f"measuring memory bandwidth ({config.bandwidth_bytes / (1 << 30):.2f} GiB buffer) and matmul peak")
    machine = measure_machine(config.bandwidth_bytes, config.repeats, config.matmul_size, config.seed)

    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    special = set(tokenizer.all_special_ids)
    max_batch = max(config.batch_sizes)
    budget = max(EngineConfig().max_num_batched_tokens, max_batch)
    block_size = EngineConfig().block_size
    longest = config.prompt_len + decode_max_tokens(
        max_batch, config.prompt_len, budget, config.warmup_steps, config.steps
    )
    engine_config = EngineConfig(
        dtype=config.dtype,
        enable_prefix_caching=False,
        max_num_seqs=max_batch,
        max_num_batched_tokens=budget,
        # Just the blocks the largest batch needs: no memory spent on an unused pool.
        num_kv_blocks=max_batch * (math.ceil(longest / block_size) + 1),
    )
    log(f"loading {model_dir}")
    core = build_engine_core(engine_config, model_dir)
    params = matmul_params_from_model(core.runner.model)
    # Weights in the runner's dtype (quantized blocks are not priced here); the KV in its own.
    weight_dtype_size, kv_dtype_size = core.runner.dtype.itemsize, core.runner.kv_dtype.itemsize
    report = RooflineReport(
        model=str(model_dir),
        dtype=config.dtype,
        prompt_len=config.prompt_len,
        steps=config.steps,
        machine=machine,
        params=params,
        kv_bytes_per_token=model_config.kv_bytes_per_token(kv_dtype_size),
    )
    peak = machine.matmul_gflops[config.dtype]
    for batch_size in config.batch_sizes:
        log(f"timing decode steps at batch {batch_size}")
        # Random ordinary tokens, drawn as bench throughput draws them, fresh per batch size.
        prompts = synthetic_prompts(
            batch_size, config.prompt_len, tokenizer.vocab_size, special, config.seed * 1_000_003 + batch_size
        )
        timing = measure_decode_steps(core, prompts, config.steps, config.warmup_steps)
        report.rows.append(
            make_row(timing, model_config, params, weight_dtype_size, kv_dtype_size, machine.bandwidth.gb_per_s, peak)
        )
    return report


def write_json(report: RooflineReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_dict(), indent=2))

"""What one simulated engine is: its step-time model and its memory, from a profile and the
what-if options (``--model-config``, ``--machine``, ``--kv-cache-memory``, ``--num-kv-blocks``).

A fleet of replicas (``--replicas``) would build one engine per replica from the same target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tokenline.model.config import ModelConfig
from tokenline.model.kv_groups import group_windows, kv_block_bytes
from tokenline.sim.accelerator import AcceleratorStepModel, accelerator_cost
from tokenline.sim.machine import DTYPE_SIZES, Machine, MachineError, load_machine, this_machine
from tokenline.sim.profile import Profile
from tokenline.sim.roofline_scaling import ModelCost, ScaledStepModel, StepTimeModel, model_cost
from tokenline.sim.step_model import StepModel

GIB = 1 << 30
DEFAULT_KV_CACHE_GIB = 2.0  # the calibrated machine's pool when nothing says otherwise
MEMORY_UTILIZATION = 0.9  # of a machine's memory for weights + KV + states (vLLM's default)


@dataclass(frozen=True)
class WhatIf:
    model_config: str | None = None  # an HF config.json (or a folder holding one)
    machine: str | None = None  # "this", a shipped name, or a JSON file
    kv_cache_memory_gib: float | None = None  # None: the machine's memory less the weights, or 2 GiB here
    num_kv_blocks: int | None = None  # overrides the memory arithmetic

    def __post_init__(self) -> None:
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("--kv-cache-memory must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("--num-kv-blocks must be >= 1")


@dataclass(frozen=True)
class SimTarget:
    step_model: StepTimeModel
    step_overhead_s: float  # host time per step beside the model's (the server's share)
    model: str
    vocab_size: int
    max_model_len: int
    kv_bytes_per_token: int
    num_kv_blocks: int
    num_state_slots: int
    machine: str
    weight_bytes: int | None = None  # known when a what-if counted the model
    request_overhead_s: float | None = None  # the machine's own (an accelerator's), else None: the profile's
    windows: tuple[int | None, ...] = (None,)  # per KV cache group, its sliding window (kv_groups.group_windows)

    @property
    def sliding_window(self) -> int | None:
        return min((w for w in self.windows if w is not None), default=None)

    def describe(self) -> str:
        weights = "" if self.weight_bytes is None else f", weights {self.weight_bytes / 1e9:.1f} GB"
        slots = f", {self.num_state_slots} state slots" if self.num_state_slots else ""
        return (f"simulating {self.model} on {self.machine}{weights}: {self.num_kv_blocks} KV blocks "
                f"({self.kv_bytes_per_token:,} B/token){slots}")


def read_model_config(spec: str) -> ModelConfig:
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"--model-config {spec}: cannot read it: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model-config {spec}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"--model-config {spec}: expected a JSON object")
    try:
        return ModelConfig.from_dict(raw, path.parent)
    except KeyError as exc:
        raise ValueError(f"--model-config {spec}: lacks the field {exc.args[0]!r}") from None


def _num_blocks(budget_bytes: int, config: ModelConfig | None, kv_bytes_per_token: int, block_size: int) -> int:
    block = kv_bytes_per_token * block_size if config is None else kv_block_bytes(config, kv_bytes_per_token, block_size)
    return max(0, budget_bytes) // max(1, block)


def resolve_target(profile: Profile, what_if: WhatIf, max_num_seqs: int, block_size: int) -> SimTarget:
    """The profile's engine, or another model and/or machine scaled from it (``roofline_scaling``)."""
    overhead = profile.step_overhead_s
    # Inside a server here the engine shares the cores with the API process: its steps run slower.
    served = scaled_step_model(profile.step_model, profile.step_scale)
    if what_if.model_config is None and what_if.machine in (None, "this"):
        if profile.step_overhead_per_seq_s:  # the API process's work for each sequence's token, here
            served = replace(served, c=served.c + profile.step_overhead_per_seq_s)
        budget = int((what_if.kv_cache_memory_gib or DEFAULT_KV_CACHE_GIB) * GIB)
        config = ModelConfig.from_dict(profile.model_config) if profile.model_config else None
        blocks = what_if.num_kv_blocks or _num_blocks(budget, config, profile.kv_bytes_per_token, block_size)
        return SimTarget(served, overhead, profile.model, profile.vocab_size, profile.max_model_len,
                         profile.kv_bytes_per_token, blocks, 0, "this",
                         windows=tuple(group_windows(config)) if config else (None,))

    source_machine = this_machine(profile.machine, profile.dtype)
    target_machine = source_machine if what_if.machine in (None, "this") else load_machine(what_if.machine)
    if profile.model_config is None:
        raise MachineError("the profile does not hold its model's config (written by an older bench calibrate); "
                           "calibrate again to use --model-config or --machine")
    if profile.dtype not in DTYPE_SIZES:
        raise MachineError(f"the profile's dtype {profile.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    source_config = ModelConfig.from_dict(profile.model_config)
    target_config = read_model_config(what_if.model_config) if what_if.model_config else source_config
    source = model_cost(source_config, DTYPE_SIZES[profile.dtype])
    target = model_cost(target_config, target_machine.dtype_size)
    # Another machine's engine has its accelerator to itself: the calibrated engine's own step times
    # scale there; this machine's server slowdown (step_scale) applies only here.
    base = served if target_machine is source_machine else profile.step_model
    request_overhead = None
    if target_machine.is_accelerator:
        # A GPU from the table has its own step model: nothing of this machine's calibration moves it.
        step_model: StepTimeModel = AcceleratorStepModel(accelerator_cost(target_config, target_machine.dtype_size),
                                                         target_machine)
        overhead = 0.0  # its fixed costs are inside the model
        if target_machine.request_overhead_ms is not None:
            request_overhead = target_machine.request_overhead_ms / 1000
    else:
        step_model = ScaledStepModel(base, source, source_machine, target, target_machine)
        if target_machine.step_overhead_ms is not None:
            overhead = target_machine.step_overhead_ms / 1000

    slots = max_num_seqs if target_config.is_hybrid else 0
    blocks = what_if.num_kv_blocks or _num_blocks(
        _cache_budget(target, target_machine, what_if.kv_cache_memory_gib) - slots * target.state_bytes_per_sequence,
        target_config, target.kv_bytes_per_token, block_size)
    if blocks < 1:
        states = f" after {slots} state slots of {target.state_bytes_per_sequence / 1e6:.0f} MB" if slots else ""
        raise MachineError(f"no KV block ({target.kv_bytes_per_token * block_size:,} B) fits in the cache "
                           f"memory{states}; raise --kv-cache-memory or lower --max-num-seqs")
    name = profile.model if not what_if.model_config else _config_name(Path(what_if.model_config).expanduser())
    return SimTarget(step_model, overhead, name, target_config.vocab_size, target_config.max_position_embeddings,
                     target.kv_bytes_per_token, blocks, slots, target_machine.name, target.weight_bytes,
                     request_overhead, tuple(group_windows(target_config)))


def scaled_step_model(model: StepModel, scale: float) -> StepModel:
    """Every coefficient times ``scale`` (the model is linear)."""
    return model if scale == 1.0 else model.scaled(scale)


def _config_name(path: Path) -> str:
    return path.name if path.is_dir() else (path.parent.name if path.stem == "config" else path.stem)


def _cache_budget(cost: ModelCost, machine: Machine, kv_cache_memory_gib: float | None) -> int:
    """Bytes for KV blocks and state slots: as stated, else the machine's usable memory less the weights."""
    if kv_cache_memory_gib is not None:
        return int(kv_cache_memory_gib * GIB)
    if machine.memory_gb is None:
        return int(DEFAULT_KV_CACHE_GIB * GIB)
    usable = int(machine.memory_gb * 1e9 * MEMORY_UTILIZATION)
    if cost.weight_bytes >= usable:
        raise MachineError(f"the model's weights ({cost.weight_bytes / 1e9:.1f} GB in {machine.dtype}) do not fit in "
                           f"{machine.name}'s {machine.memory_gb:g} GB (at {MEMORY_UTILIZATION:.0%} use)")
    return usable - cost.weight_bytes

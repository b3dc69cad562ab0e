"""Machine profiles for ``tokenline simulate --machine``: the three figures a roofline needs.

``this`` is the machine the profile was calibrated on (bandwidth and matmul peak measured by
``bench calibrate``); the others are published figures, shipped as JSON under ``machines/``, or
any JSON file with the same fields. A machine with achieved fractions (``bandwidth_efficiency``
and the others) is an accelerator priced by its own step model (``accelerator.py``; the figures
and their sources in docs/operate/planner.md), with the price per hour a fleet plan uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MACHINES_DIR = Path(__file__).parent / "machines"
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class MachineError(ValueError):
    """A machine name or file that cannot be used."""


@dataclass(frozen=True)
class Machine:
    name: str
    memory_bandwidth_gbps: float  # GB/s, decimal as vendors quote it
    matmul_tflops: float  # dense matmul peak at ``dtype``
    memory_gb: float | None  # None: no memory figure (the KV pool comes from --kv-cache-memory)
    dtype: str  # what weights and KV are held in there
    description: str = ""
    # Host time per step beyond the model (the server's own work). None: the profile's, measured here.
    step_overhead_ms: float | None = None
    # An accelerator's own step model (accelerator.py): achieved fractions of the peaks and fixed
    # costs. None: the machine is priced by scaling the calibrated one (roofline_scaling.py).
    bandwidth_efficiency: float | None = None
    matmul_efficiency: float | None = None
    attention_efficiency: float | None = None
    layer_overhead_us: float = 0.0  # per layer per step: kernels too small to reach the roofline
    request_overhead_ms: float | None = None  # per request outside the engine (HTTP, tokenize)
    fp8_tflops: float | None = None
    interconnect_gbps: float | None = None  # per direction, between the GPUs of a tensor-parallel group
    price_per_hour: float | None = None  # US$ per GPU-hour (an assumption: see price_note)
    price_note: str = ""

    @property
    def is_accelerator(self) -> bool:
        """Priced by its own step model (accelerator.py), not by scaling the calibrated machine."""
        return self.bandwidth_efficiency is not None

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbps * 1e9

    @property
    def peak_flops_per_s(self) -> float:
        return self.matmul_tflops * 1e12


def builtin_machines() -> list[str]:
    return sorted(p.stem for p in MACHINES_DIR.glob("*.json"))


def this_machine(machine_info: dict[str, Any], dtype: str) -> Machine:
    """The calibrated machine, from the roofline figures ``bench calibrate`` stored in the profile."""
    try:
        bandwidth = float(machine_info["memory_bandwidth_gbps"])
        tflops = float(machine_info["matmul_gflops"]) / 1000
    except (KeyError, TypeError, ValueError):
        raise MachineError("the profile has no measured bandwidth and matmul peak (written by an older "
                           "bench calibrate); calibrate again to use --model-config or --machine") from None
    return Machine("this", bandwidth, tflops, None, dtype, "the calibrated machine (measured)")


def load_machine(spec: str) -> Machine:
    """A shipped machine by name (``h200``) or a JSON file with the same fields."""
    path = MACHINES_DIR / f"{spec}.json"
    if not path.is_file():
        path = Path(spec).expanduser()
        if not path.is_file():
            known = ", ".join(["this", *builtin_machines()])
            raise MachineError(f"--machine {spec!r}: neither a known machine ({known}) nor a JSON file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MachineError(f"--machine {path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise MachineError(f"--machine {path}: expected a JSON object")
    try:
        machine = Machine(
            name=str(raw.get("name", path.stem)),
            memory_bandwidth_gbps=float(raw["memory_bandwidth_gbps"]),
            matmul_tflops=float(raw["matmul_tflops"]),
            memory_gb=None if raw.get("memory_gb") is None else float(raw["memory_gb"]),
            dtype=str(raw.get("dtype", "bfloat16")),
            description=str(raw.get("description", "")),
            step_overhead_ms=_number(raw, "step_overhead_ms"),
            bandwidth_efficiency=_number(raw, "bandwidth_efficiency"),
            matmul_efficiency=_number(raw, "matmul_efficiency"),
            attention_efficiency=_number(raw, "attention_efficiency"),
            layer_overhead_us=_number(raw, "layer_overhead_us") or 0.0,
            request_overhead_ms=_number(raw, "request_overhead_ms"),
            fp8_tflops=_number(raw, "fp8_tflops"),
            interconnect_gbps=_number(raw, "interconnect_gbps"),
            price_per_hour=_number(raw, "price_per_hour"),
            price_note=str(raw.get("price_note", "")),
        )
    except KeyError as exc:
        raise MachineError(f"--machine {path}: lacks the field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise MachineError(f"--machine {path}: a field is not a number: {exc}") from None
    if machine.dtype not in DTYPE_SIZES:
        raise MachineError(f"--machine {path}: dtype {machine.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    if machine.memory_bandwidth_gbps <= 0 or machine.matmul_tflops <= 0 or (machine.memory_gb or 1) <= 0:
        raise MachineError(f"--machine {path}: bandwidth, matmul peak and memory must be > 0")
    if (machine.step_overhead_ms or 0) < 0:
        raise MachineError(f"--machine {path}: step_overhead_ms must be >= 0")
    fractions = (machine.bandwidth_efficiency, machine.matmul_efficiency, machine.attention_efficiency)
    if machine.is_accelerator and not all(f is not None and 0 < f <= 1 for f in fractions):
        raise MachineError(f"--machine {path}: bandwidth_efficiency, matmul_efficiency and attention_efficiency "
                           "must all be given, each in (0, 1]")
    return machine


def _number(raw: dict[str, Any], key: str) -> float | None:
    return None if raw.get(key) is None else float(raw[key])

"""The JSON profile ``tokenline bench calibrate`` writes and ``tokenline simulate`` reads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenline.sim.step_model import StepModel

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that is missing, not JSON, or lacks a field."""


@dataclass
class Profile:
    step_model: StepModel
    model: str  # the model directory's name
    dtype: str
    machine: dict[str, Any]  # platform, processor, CPU count, torch threads: where the fit holds
    vocab_size: int
    max_model_len: int
    kv_bytes_per_token: int  # every attention layer's; sizes the simulated KV pool (kv_groups.kv_block_bytes)
    # Per request, outside the engine (HTTP, tokenize, detokenize, streaming): added to TTFT and E2E.
    request_overhead_s: float = 0.0
    num_steps: int = 0  # steps the fit used
    # Per step, in a server beside the engine's own step (sending outputs, the API process's share of
    # the cores): added to every simulated step.
    step_overhead_s: float = 0.0
    step_scale: float = 1.0  # how much slower the engine's steps run inside a server on this machine
    server_steps: int = 0  # server steps that fit and step_overhead_s used (0: no server run)
    model_config: dict[str, Any] | None = None  # the calibrated model's config.json: what-ifs scale from it
    # The neighbours' CPU the calibration saw (calibration_load.CalibrationLoad.to_dict); None: not measured.
    load: dict[str, Any] | None = None
    max_num_batched_tokens: int | None = None  # the largest step the design ran (its step budget)
    # Per decoding sequence of a step, in a server (its token's detokenizing and streaming in the API
    # process, beside the engine on shared cores): added to the step's price here (0: profiles before it).
    step_overhead_per_seq_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{path} is not a tokenline profile (version {PROFILE_VERSION}); run tokenline bench calibrate")
        try:
            raw.pop("version")
            raw["step_model"] = StepModel(**raw["step_model"])
            return cls(**raw)
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"profile {path} lacks a field or has an unknown one: {exc}") from exc

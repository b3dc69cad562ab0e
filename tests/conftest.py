"""Fixtures shared by every test package."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) imported into tokenline's format, imported once."""
    from tokenline.store.model_store import resolve_model

    return resolve_model(None, progress=False)


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5 tokenizer files, built once a session (its BPE merges take seconds of CPU).
    Read-only: a test that edits a file copies the directory first."""
    from tokenline.frontend.qwen_vocab import build_qwen_tokenizer

    out = tmp_path_factory.mktemp("qwen_tokenizer")
    build_qwen_tokenizer(out)
    return out


@pytest.fixture
def batched_prefill_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every step's prefill spans go through attention in one padded call, whatever their size (the
    thresholds only pick the faster path); the list fills with each call's number of spans."""
    from tokenline.model import attention, prefill_attention

    monkeypatch.setattr(prefill_attention, "BATCHED_PREFILL_MIN_SPANS", 2)
    monkeypatch.setattr(prefill_attention, "BATCHED_PREFILL_MAX_QUERY_BYTES", 10**12)
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(len(args[5]))  # the spans
        prefill_attention.prefill_batched(*args, **kwargs)

    monkeypatch.setattr(attention, "prefill_batched", counted)
    return calls


TinyQwen3_5 = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: Path) -> TinyQwen3_5:
    """``tiny_qwen3_5(linear_scale=None, mtp_layers=1)``: the tiny Qwen3.5 hybrid (seed 0) with the
    Qwen tokenizer, each variant built once a session (seconds each, and a dozen modules use it).
    ``linear_scale``: DeltaNet outputs scaled up (``scale_qwen3_5_linear_outputs``). The directory
    is shared and read-only: a test that edits it copies it first."""
    from tokenline.model.random_models import make_qwen3_5_tiny, scale_qwen3_5_linear_outputs

    built: dict[tuple[float | None, int], Path] = {}

    def variant(linear_scale: float | None = None, mtp_layers: int = 1) -> Path:
        key = (linear_scale, mtp_layers)
        if key not in built:
            out = tmp_path_factory.mktemp(f"qwen3_5_tiny_mtp{mtp_layers}_x{linear_scale}") / "qwen3.5-tiny"
            if linear_scale is None:
                make_qwen3_5_tiny(out, seed=0, mtp_layers=mtp_layers)
                shutil.copytree(qwen_tokenizer_dir, out, dirs_exist_ok=True)
            else:  # the same weights as the unscaled variant, then louder linear layers
                shutil.copytree(variant(None, mtp_layers), out)
                scale_qwen3_5_linear_outputs(out, linear_scale)
            built[key] = out
        return built[key]

    return variant

"""Fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) imported into tokenline's format, imported once."""
    from tokenline.model.model_store import resolve_model

    return resolve_model(None, progress=False)

"""Fixtures shared by the model tests."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from tokenline.model import cpu_kernels


@pytest.fixture(scope="module")
def portable_build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[tuple[str, ...]], cpu_kernels.CpuKernels]:
    """The C kernels compiled with extra flags (e.g. ``-mno-avx512bf16``, to run the portable paths on
    this CPU), each build once a module, in a kernel cache of its own rather than the user's."""
    home = tmp_path_factory.mktemp("portable_kernels")

    @functools.cache
    def build(flags: tuple[str, ...]) -> cpu_kernels.CpuKernels:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TOKENLINE_HOME", str(home))
            return cpu_kernels.CpuKernels(cpu_kernels.build(extra_flags=flags))

    return build

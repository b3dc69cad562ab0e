"""Counting the one-call decode layer's kernel calls, for tests that compare it with the torch path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tokenline.model import cpu_kernels


@contextmanager
def counted_decode_layer_calls(kernels: cpu_kernels.CpuKernels) -> Iterator[list[int]]:
    """Inside the block, ``kernels.decode_layer_`` runs as before and each call's row count is appended
    to the yielded list; the original is restored on the way out."""
    calls: list[int] = []
    original = kernels.decode_layer_

    def counting(x: torch.Tensor, *args: object) -> None:
        calls.append(x.shape[0])
        original(x, *args)

    kernels.decode_layer_ = counting  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        kernels.decode_layer_ = original  # type: ignore[method-assign]

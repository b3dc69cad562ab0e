"""One copy of a float32 linear layer's weight on CPU, in the column panels our matmul kernel reads.

A [N, K] weight becomes ``panels`` [ceil(N / 16), K, 16]: panel ``t`` holds output columns
``16 t .. 16 t + 15``, input by input, zero past N. The kernel (``tl_linear_panels_f32``) then
multiplies as an outer product, one panel row by each row of x broadcast, which reaches the
machine's matmul peak where a dot product over the plain rows reached half of it. The plain weight
is dropped once packed: :func:`unpack` and :func:`rows` read the panels back.
"""

from __future__ import annotations

import torch

PANEL = 16  # output columns per panel (TL_PANEL in csrc/cpu_kernels.c)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The panels of a 2-D float32 weight [N, K] (a fresh contiguous tensor)."""
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    plain = weight.detach()
    if padded != n:
        plain = torch.cat([plain, plain.new_zeros(padded - n, k)])
    return plain.reshape(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """A fresh plain [n, K] copy: for a reader that needs the matrix, and for MKL's sgemm on a long
    prefill chunk (layers.F32_PANEL_ROWS), where the copy costs a few percent of the product."""
    count, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(count * PANEL, k)[:n].contiguous()


def rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """w[ids] as plain rows [*ids.shape, K] (a tied embedding's lookup)."""
    flat = ids.reshape(-1)
    picked = panels[flat // PANEL, :, flat % PANEL]  # [T, K]
    return picked.reshape(*ids.shape, panels.shape[1])

"""One copy of a linear layer's bfloat16 weight on CPU: oneDNN's packed layout, read by oneDNN for
larger batches and, in place, by our C kernel for decode rows and by a tied embedding's lookups.

oneDNN packs a [N, K] inner-product weight into tiles (``AB<P>b<NB>a2b``: tiles of NB output
columns x 2P inputs, column block major; inside a tile, input pair p holds NB columns x 2 inputs;
zero padding to whole tiles). Which NB and P it picks depends on the CPU (AMX or AVX-512), so
:func:`pack` does not assume one: it tries the candidates against the plain weight, byte for byte,
and reports none when the layout is something else (the caller then keeps the plain weight).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

CANDIDATE_BLOCK_N = (16, 32, 64)
CANDIDATE_PAIRS = (2, 4, 8, 16, 32)


@dataclass(frozen=True)
class BlockedLayout:
    block_n: int  # output columns per tile (NB)
    pairs: int  # input pairs per tile (P): a tile spans 2 * pairs inputs

    def padded_shape(self, n: int, k: int) -> tuple[int, int]:
        return -(-n // self.block_n) * self.block_n, -(-k // (2 * self.pairs)) * 2 * self.pairs


@dataclass
class PackedWeight:
    """A packed [out_features, in_features] weight; ``tiles`` views ``onednn``'s bytes (keep this
    object alive while using it)."""

    onednn: torch.Tensor  # oneDNN's opaque tensor, for torch.ops.mkldnn._linear_pointwise
    tiles: torch.Tensor  # its bytes as a flat bfloat16 tensor (no copy)
    out_features: int
    in_features: int
    layout: BlockedLayout | None  # None: oneDNN chose a layout we cannot read

    def _grid(self) -> torch.Tensor:
        """The tiles as [column block, column, input block, pair, 2]: element [n // NB, n % NB,
        k // 2P, (k % 2P) // 2, k % 2] is w[n, k] (a strided view, no copy)."""
        assert self.layout is not None
        nb, p = self.layout.block_n, self.layout.pairs
        n_pad, k_pad = self.layout.padded_shape(self.out_features, self.in_features)
        kblocks = k_pad // (2 * p)
        strides = (kblocks * p * nb * 2, 2, p * nb * 2, nb * 2, 1)
        return self.tiles.as_strided((n_pad // nb, nb, kblocks, p, 2), strides)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """w[ids] as plain rows [*ids.shape, in_features] (a tied embedding's lookup)."""
        assert self.layout is not None
        flat = ids.reshape(-1)
        nb = self.layout.block_n
        picked = self._grid()[flat // nb, flat % nb]  # [T, kblocks, pairs, 2]
        out = picked.reshape(flat.numel(), -1)[:, : self.in_features]
        return out.reshape(*ids.shape, self.in_features)

    def unpack(self) -> torch.Tensor:
        """A fresh plain copy of the whole weight (for a reader that needs it; not on a hot path)."""
        assert self.layout is not None
        grid = self._grid()
        plain = grid.reshape(grid.shape[0] * grid.shape[1], -1)  # copies: the grid is not contiguous
        return plain[: self.out_features, : self.in_features].contiguous()


def _raw_bf16(onednn: torch.Tensor) -> torch.Tensor:
    nbytes = torch.ops.mkldnn._nbytes(onednn)
    buffer = (ctypes.c_uint8 * nbytes).from_address(torch.ops.mkldnn.data_ptr(onednn))
    return torch.frombuffer(buffer, dtype=torch.bfloat16)


def pack(weight: torch.Tensor, batch_hint: int) -> PackedWeight:
    """oneDNN's packed copy of a 2-D bfloat16 CPU weight, with its layout when we can read it."""
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    n, k = weight.shape
    tiles = _raw_bf16(onednn) if hasattr(torch.ops.mkldnn, "data_ptr") else torch.empty(0, dtype=torch.bfloat16)
    packed = PackedWeight(onednn, tiles, n, k, None)
    for block_n in CANDIDATE_BLOCK_N:
        for pairs in CANDIDATE_PAIRS:
            layout = BlockedLayout(block_n, pairs)
            n_pad, k_pad = layout.padded_shape(n, k)
            if n_pad * k_pad != tiles.numel():
                continue
            packed.layout = layout
            if torch.equal(packed.unpack(), weight):
                return packed
    packed.layout = None
    return packed

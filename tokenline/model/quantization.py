"""Weight-only quantization in ggml's block formats, so a linear layer reads 4 or 8 bits a weight.

``--quantization q4_1`` / ``q8_0`` replace each linear layer's weight, once it is loaded, by blocks
of 32 weights along the input dimension, quantized as ggml's reference quantizers do:

- Q4_1: fp16 scale d, fp16 minimum m, 32 four-bit codes; w = d * q + m (20 bytes a block);
- Q8_0: fp16 scale d, 32 int8 codes; w = d * q (34 bytes a block).

The output head stays Q8_0 under q4_1 (as llama.cpp's files keep it at more bits). For a model
imported from a GGUF these are the file's own blocks: quantizing the dequantized weights again
reproduces the file's bytes exactly (all 211 of the default model's; tests/model/test_quantization.py
keeps checking two layers and the embedding), so tokenline serves the same numbers llama.cpp serves
from that file. The CPU kernel (``tl_linear_q``) reads the blocks in place for a few decode rows and
expands small tiles for more; beside bfloat16 rows on a CPU with AVX-512 BF16, ``tl_linear_q_bf16``
expands each panel of 16 weight rows once into exact bfloat16 codes for every row (decode batches,
prefill chunks); only a long prefill chunk dequantizes a whole matrix. A bfloat16 model's blocks on a
CPU with AVX-512 VNNI are instead reordered once at load (``pack_panels``: the same bytes, the only
copy) for ``tl_linear_qp``, which rounds the rows to int8 per block as llama.cpp does and multiplies
with vpdpbusd at every batch size, decode steps and prefill chunks alike, never unpacking a panel
(the outputs differ from the dequantized weight's by that rounding; a row's do not depend on the
rows beside it). A float32 model keeps the exact kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, along the input dimension
# The C kernel's codes (TL_W_* in csrc/cpu_kernels.c) and each format's bytes a block.
FORMAT_CODES = {"q4_1": 1, "q8_0": 2}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
CODE_BLOCK_BYTES = {FORMAT_CODES[f]: BLOCK_BYTES[f] for f in FORMAT_CODES}
QUANTIZATIONS = tuple(FORMAT_CODES)  # the values of --quantization
HEAD_FORMAT = "q8_0"  # the output head's format whatever the layers' (llama.cpp keeps it at more bits)


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight as ``blocks`` [out_features, in_features / 32 * bytes] uint8."""

    fmt: str
    blocks: torch.Tensor
    out_features: int
    in_features: int
    # The same bytes reordered into panels of 16 rows as tl_linear_qp reads them (pack_panels).
    packed: bool = False

    @property
    def code(self) -> int:
        return FORMAT_CODES[self.fmt]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """w[ids] dequantized to float32, [*ids.shape, in_features] (a tied embedding's lookup)."""
        flat = ids.reshape(-1)
        if self.packed and self.fmt == "q8_0":  # a tied head's embedding: each row's bytes picked out
            picked = _packed_q8_0_rows(self.blocks, flat, self.in_features)
        elif self.packed:  # the panels holding the rows (each once: a long prompt repeats tokens), unpacked
            row_bytes = self.blocks.shape[1]
            wanted, where = torch.unique(flat // PANEL_ROWS, return_inverse=True)
            panels = self.blocks.view(-1, PANEL_ROWS, row_bytes)[wanted].reshape(-1, row_bytes)
            blocks = _unpack_blocks(panels, self.fmt).view(-1, PANEL_ROWS, row_bytes)
            picked = blocks[where, flat % PANEL_ROWS]
        else:
            picked = self.blocks[flat]
        out = _dequantize_blocks(picked, self.fmt, self.in_features)
        return out.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight in float32 (a reader that needs it; not the hot path)."""
        return _dequantize_blocks(self.ggml_blocks(), self.fmt, self.in_features)

    def ggml_blocks(self) -> torch.Tensor:
        """The blocks in ggml's row-major order: ``blocks`` itself, or a copy unpacked from the panels."""
        return _unpack_blocks(self.blocks, self.fmt) if self.packed else self.blocks


PANEL_ROWS = 16  # weight rows a packed panel holds: one AVX-512 vector of outputs


def pack_panels(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` with its blocks reordered for tl_linear_qp (same bytes a weight, no other copy kept): per
    panel of 16 rows and block of 32 inputs, the 16 rows' fp16 d (Q4_1: then their m), then the codes
    with 4 consecutive inputs of row j in 32-bit lane j: Q8_0's as bytes q + 128 (8 vectors of 64),
    Q4_1's two a byte (4 vectors; the low nibbles inputs 0-15's groups, the high 16-31's)."""
    if q.packed or q.out_features % PANEL_ROWS:
        raise ValueError(f"pack_panels: a [{q.out_features}, {q.in_features}] weight (packed={q.packed}) "
                         f"does not split into panels of {PANEL_ROWS} rows")
    n, nb, bb = q.out_features, q.in_features // BLOCK, BLOCK_BYTES[q.fmt]
    b = q.blocks.view(n // PANEL_ROWS, PANEL_ROWS, nb, bb).permute(0, 2, 1, 3)  # [P, nb, 16, bb]
    lanes = (n // PANEL_ROWS, nb, 16, 8, 4)
    if q.fmt == "q8_0":
        scales = b[..., 0:2]
        codes = (b[..., 2:] ^ 0x80).reshape(lanes).permute(0, 1, 3, 2, 4).reshape(*lanes[:2], 8, 64)
    else:
        scales = torch.cat((b[..., 0:2], b[..., 2:4]), dim=-2)  # 16 d's then 16 m's
        raw = b[..., 4:]
        q_codes = torch.cat((raw & 0x0F, raw >> 4), dim=-1)  # [P, nb, 16, 32] in input order
        grouped = q_codes.reshape(lanes).permute(0, 1, 3, 2, 4).reshape(*lanes[:2], 8, 64)
        codes = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)
    chunk = torch.cat((scales.reshape(*lanes[:2], -1), codes.reshape(*lanes[:2], -1)), dim=-1)
    return QuantizedWeight(q.fmt, chunk.reshape(n, nb * bb).contiguous(), n, q.in_features, packed=True)


def _packed_q8_0_rows(packed: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``rows`` of a packed Q8_0 weight as ggml's blocks [len(rows), row bytes]: row j of a panel
    keeps its d at bytes 2j, 2j + 1 of each block's chunk and input 4g + t at 32 + 64g + 4j + t (+ 128).
    One gather of the rows' own bytes: 2.7 ms for a 1,024-token prefill chunk of Gemma 3's
    262,144-row head, where unpacking the rows' whole panels took 26.6 ms (0.23 against 0.92 ms for
    a 32-row decode step)."""
    nb, bb = in_features // BLOCK, BLOCK_BYTES["q8_0"]
    chunk_bytes = PANEL_ROWS * bb
    lane = rows % PANEL_ROWS
    codes = (32 + 64 * torch.arange(8).repeat_interleave(4) + torch.arange(4).repeat(8))  # input order
    within = torch.cat((2 * lane[:, None] + torch.arange(2), codes[None, :] + 4 * lane[:, None]), dim=1)  # [R, 34]
    start = (rows // PANEL_ROWS) * (nb * chunk_bytes)
    offsets = start[:, None, None] + (torch.arange(nb) * chunk_bytes)[None, :, None] + within[:, None, :]
    blocks = packed.reshape(-1)[offsets]  # [R, nb, 34]
    blocks[..., 2:] ^= 0x80
    return blocks.reshape(len(rows), nb * bb)


def _unpack_blocks(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """pack_panels' inverse on [rows (a multiple of 16), row bytes] packed bytes: ggml's blocks."""
    n, row_bytes = packed.shape
    bb = BLOCK_BYTES[fmt]
    nb = row_bytes // bb
    chunk = packed.reshape(n // PANEL_ROWS, nb, PANEL_ROWS * bb)
    lanes = (n // PANEL_ROWS, nb, 8, 16, 4)
    if fmt == "q8_0":
        head = chunk[..., :32].reshape(*lanes[:2], 16, 2)
        codes = (chunk[..., 32:].reshape(lanes) ^ 0x80).permute(0, 1, 3, 2, 4).reshape(*lanes[:2], 16, 32)
        blocks = torch.cat((head, codes), dim=-1)
    else:
        d, m = chunk[..., :32].reshape(*lanes[:2], 16, 2), chunk[..., 32:64].reshape(*lanes[:2], 16, 2)
        both = chunk[..., 64:].reshape(*lanes[:2], 4, 64)
        grouped = torch.cat((both & 0x0F, both >> 4), dim=2).reshape(lanes)  # groups 0-3, then 4-7
        q_codes = grouped.permute(0, 1, 3, 2, 4).reshape(*lanes[:2], 16, 32)
        blocks = torch.cat((d, m, q_codes[..., :16] | (q_codes[..., 16:] << 4)), dim=-1)
    return blocks.permute(0, 2, 1, 3).reshape(n, row_bytes).contiguous()


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """ggml's reference quantizer for ``fmt`` over a 2-D weight whose input width is a multiple of 32."""
    if fmt not in FORMAT_CODES:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(QUANTIZATIONS)}")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"a [{n}, {k}] weight does not split into blocks of {BLOCK} inputs")
    # A few rows at a time: the temporaries of a whole head (49k x 576) would add ~0.5 GB to the load's peak.
    rows = max(1, (1 << 20) // k)
    blocks = torch.cat([_quantize_rows(weight[i:i + rows], fmt) for i in range(0, n, rows)])
    return QuantizedWeight(fmt, blocks, n, k)


def _quantize_rows(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    n, k = weight.shape
    x = weight.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    if fmt == "q4_1":
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (high - low) / 15.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        # (int8_t)(x0 + 0.5f) truncates a non-negative value: floor
        q = torch.floor((x - low) * inv + 0.5).clamp_(max=15).to(torch.uint8)
        codes = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
        head = torch.cat((_half_bytes(d), _half_bytes(low)), dim=-1)
    else:
        amax = x.abs().amax(-1, keepdim=True)
        d = amax / 127.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        scaled = x * inv
        q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8)  # C's roundf
        codes = q.view(torch.uint8)
        head = _half_bytes(d)
    return torch.cat((head, codes), dim=-1).reshape(n, -1)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] as its float16's two little-endian bytes [..., 2]."""
    return values.to(torch.float16).view(torch.uint8)


def _dequantize_blocks(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    rows = blocks.reshape(-1, in_features // BLOCK, BLOCK_BYTES[fmt])
    d = rows[..., 0:2].contiguous().view(torch.float16).float()
    if fmt == "q4_1":
        m = rows[..., 2:4].contiguous().view(torch.float16).float()
        codes = rows[..., 4:]
        q = torch.cat((codes & 0x0F, codes >> 4), dim=-1).float()
        out = d * q + m
    else:
        out = d * rows[..., 2:].contiguous().view(torch.int8).float()
    return out.reshape(*blocks.shape[:-1], in_features)

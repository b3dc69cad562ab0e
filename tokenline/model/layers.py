"""The shared layer library every model is built from: RMSNorm and its variants, rotary position
embedding (full or partial), linear layers (plain and merged), the SwiGLU MLP and softmax attention
over the paged KV cache.

The maths follows the HF reference operation for operation (same dtypes at the same points), so
greedy outputs match it token for token.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenline.model import cpu_kernels, panel_weight
from tokenline.model.attention import AttentionMetadata, paged_attention
from tokenline.model.config import ModelConfig
from tokenline.model.packed_weight import PackedWeight, pack
from tokenline.model.quantization import BLOCK, HEAD_FORMAT, PANEL_ROWS, QuantizedWeight, pack_panels, quantize


@functools.cache
def small_batch_rows() -> int:
    """Up to this many rows (decode batches, short prefill chunks, the LM head's sampled rows) our
    streaming kernel serves a packed bfloat16 weight on CPU: 2 where oneDNN multiplies on AMX tiles
    (the developers' machine); on AVX512-BF16 without AMX, up to the one-call layer's 64, where it
    beats oneDNN at every row count (2 threads, the default model's shapes: the layer's linears
    0.7x oneDNN's time at 16-64 rows, the 49152-row head 0.7-0.75x; docs/benchmarks, "Many rows")."""
    return 2 if cpu_kernels.cpu_has_amx() else cpu_kernels.DECODE_LAYER_MAX_ROWS

# The batch size oneDNN lays packed weights out for; any batch size still works with them.
PACKED_BATCH_HINT = 32
# Quantized weights: below this many rows our kernel reads the blocks (up to 8 rows in place, more
# through small dequantized tiles); from here (prefill) dequantizing the matrix once and multiplying in
# float wins. 2 threads on the AVX2 box here, the default model's gate|up: 4.7 vs 5.8 ms at 64 rows,
# 8.7 vs 7.2 at 128 (the head, 49k rows: 105 vs 130 ms even at 128; a float copy of it is 113 MB).
QUANTIZED_GEMV_ROWS = 128
# float32 on CPU: below this many rows our panel kernel beats MKL's sgemm (2 threads on the AVX2 box
# here, the default model's layer: 5.3 vs 7.0 ms at 64 rows, 18.6 vs 18.3 at 256); from here a
# prefill chunk multiplies by a transient plain copy with MKL (2048 rows: 114 vs 150 ms, the copy 3.4).
F32_PANEL_ROWS = 512
# Quantized weights beside bfloat16 rows, on a CPU with AVX-512 BF16: from this many rows the blocks are
# expanded once per panel of 16 outputs and multiplied with vdpbf16ps for all rows (tl_linear_q_bf16),
# below it the float kernel reads them in place (1 thread, the default model's layer: 0.73 vs 0.61 ms
# at 4 rows, 2.0 vs 4.2 / 5.1 ms (q8_0 / q4_1) at 32; bench/quant_batched.py, docs/benchmarks).
QUANTIZED_BF16_ROWS = 4
# ... and up to here (prefill chunks) rather than dequantizing the whole matrix for oneDNN (1 thread, the
# layer at 128 rows: 6.2 vs 9.0 ms; at 512 even, 22 ms both ways).
QUANTIZED_BF16_DEQUANT_ROWS = 512


class RMSNorm(nn.Module):
    """``w * norm(x)``: normalised in float32, cast back to the activation dtype, then scaled (Llama)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32, whatever the activation dtype, as the reference does."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.bfloat16 and x.device.type == "cpu" and self.weight.dtype == dtype:
            kernels = cpu_kernels.load()
            if kernels is not None:
                return kernels.rms_norm_bf16(x, self.weight, self.eps)
        return self.weight * self.normalise(x).to(dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """``norm(x) * (1 + w)`` (w starts at 0), scaled in float32 *before* the cast back (Qwen3.5)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalise(x) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """``w * norm(x) * silu(gate)``: the plain norm, then the gate in float32 (the Gated DeltaNet's output norm)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for RoPE and the attention scaling factor, per the config's rope type."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope scaling type {kind!r} is not supported")


RotaryRows = tuple[torch.Tensor, torch.Tensor]  # cos and sin for a step's positions, [T, 1, rotary_dim]


class RotaryEmbedding:
    """cos and sin of RoPE (rotate-half layout) over the first ``rotary_dim`` dims of each head.

    Computed per step from the positions (once per step, shared by all layers) rather than looked
    up in a table: the values are the same float32 products, nothing depends on the maximum model
    length, and a model built on the meta device holds no buffer left to fill.
    """

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.scaling = scaling
        self._inv_freq: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryRows:
        """cos and sin for a step's positions, computed in float32 then cast."""
        cached = self._inv_freq.get(positions.device)
        if cached is None:
            inv_freq, scale = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
            cached = self._inv_freq[positions.device] = (inv_freq.to(positions.device), scale)
        inv_freq, scale = cached
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: RotaryRows) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, heads, head_dim] and k [T, kv_heads, head_dim]; with cos/sin narrower than a
    head (partial rotary) only the first dims rotate and the rest pass through."""
    cos, sin = cos_sin
    rotary_dim = cos.shape[-1]
    if rotary_dim < q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :rotary_dim], k[..., :rotary_dim], cos_sin)
        return torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Linear(nn.Linear):
    """``nn.Linear`` that, once :meth:`prepare_for_inference` ran, takes the fastest CPU path.

    bfloat16 on CPU: the weight is packed once at load time for oneDNN (plain ``F.linear``
    re-lays it out on every call), which serves larger batches; a handful of rows (a decode step)
    goes through our weight-streaming kernel, reading the same packed bytes. The plain weight is
    then dropped (``weight`` is None; :meth:`plain_weight` rebuilds it), so the layer holds one
    copy. It is kept only where our kernel cannot read oneDNN's layout, or with
    ``TOKENLINE_KEEP_PLAIN_WEIGHTS=1`` (to measure the memory it costs). float32 on CPU: the weight
    is repacked into column panels (model/panel_weight.py, the only copy held) and calls of fewer
    than ``F32_PANEL_ROWS`` rows (decode steps, short prefill chunks, the LM head's sampled rows) go
    through our outer-product kernel, whose sums differ from MKL's only in order and do not depend
    on the other rows; a longer prefill chunk unpacks a transient plain copy for MKL's sgemm.
    Other dtypes and devices use ``F.linear``.
    """

    _kernels: cpu_kernels.CpuKernels | None = None
    _packed: PackedWeight | None = None
    _panels: torch.Tensor | None = None
    _quantized: QuantizedWeight | None = None

    def quantize_(self, fmt: str) -> bool:
        """Hold the weight only as ``fmt`` blocks (``--quantization``); False where it cannot be
        (not a CPU weight, or an input width that is not a multiple of 32)."""
        weight = self.weight
        if weight is None or weight.device.type != "cpu" or self.in_features % BLOCK:
            return False
        self._quantized = quantize(weight, fmt)
        self._kernels = cpu_kernels.load()
        # A bfloat16 model's: repacked for tl_linear_qp (the only copy), which rounds the rows to int8 per
        # block as llama.cpp does; a float32 model keeps the kernels that multiply its rows exactly.
        if (weight.dtype == torch.bfloat16 and self._kernels is not None and self._kernels.has_avx512vnni
                and self.out_features % PANEL_ROWS == 0):
            self._quantized = pack_panels(self._quantized)
        self.register_parameter("weight", None)
        return True

    def prepare_for_inference(self, keep_plain: bool = False) -> None:
        weight = self.weight
        if weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
            self._kernels = cpu_kernels.load()
            if self._kernels is not None:
                self._panels = panel_weight.pack(weight)
                if not keep_plain:
                    self.register_parameter("weight", None)
            return
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return
        self._kernels = cpu_kernels.load() if self.bias is None else None
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and cpu_kernels.cpu_has_native_bf16()):
            return  # oneDNN packs bf16 weights only on CPUs that compute in bf16; F.linear elsewhere
        self._packed = pack(weight, PACKED_BATCH_HINT)
        readable = self._packed.layout is not None
        if not keep_plain and (readable or self._kernels is None):
            self.register_parameter("weight", None)

    def plain_weight(self) -> torch.Tensor:
        """The [out, in] weight: the parameter, or a fresh copy unpacked from the packed one."""
        if self.weight is not None:
            return self.weight
        if self._quantized is not None:
            return self._quantized.dequantize()
        if self._panels is not None:
            return panel_weight.unpack(self._panels, self.out_features)
        assert self._packed is not None
        if self._packed.layout is None:
            return self._packed.onednn.to_dense()
        return self._packed.unpack()

    def float32_panels(self) -> torch.Tensor | None:
        """The weight as float32 column panels: the layer's own once prepared, else packed now from a
        plain float32 CPU weight (a copy); None for other weights."""
        if self._panels is not None:
            return self._panels
        weight = self.weight
        if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        return panel_weight.pack(weight)

    def has_readable_packed_copy(self) -> bool:
        """Whether the layer holds its weight packed in a layout :meth:`weight_rows` reads (float32
        panels, or oneDNN tiles whose layout we recognised), so the plain copy can go."""
        return self._panels is not None or (self._packed is not None and self._packed.layout is not None)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the [out, in] weight, read from the packed copy (a tied embedding's lookup)."""
        if self._panels is not None:
            return panel_weight.rows(self._panels, ids)
        assert self._packed is not None and self._packed.layout is not None
        return self._packed.rows(ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._quantized is not None:
            return self._quantized_forward(x)
        if self._panels is not None and self._kernels is not None:
            rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
            if rows.shape[0] < F32_PANEL_ROWS:
                y = self._kernels.linear_panels_f32(rows, self._panels, self.out_features)
            else:
                y = F.linear(rows, panel_weight.unpack(self._panels, self.out_features))
            if self.bias is not None:
                y += self.bias
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if self._kernels is not None and x.dim() == 2 and x.shape[0] <= small_batch_rows():
            if self.weight is not None:
                return self._kernels.linear_bf16(x.contiguous(), self.weight)
            packed = self._packed
            assert packed is not None and packed.layout is not None
            return self._kernels.linear_bf16_blocked(
                x.contiguous(), packed.tiles, packed.out_features, packed.layout.block_n, packed.layout.pairs
            )
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed.onednn, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Packed panels (a bfloat16 model's, on a VNNI CPU): tl_linear_qp at every row count, decode
        batches and prefill chunks alike, the rows rounded to int8 per block of 32 (a row's outputs do
        not depend on the rows beside it, so a prompt's numbers do not depend on how it is chunked).
        Blocks in ggml's order, fewer than QUANTIZED_GEMV_ROWS rows: our kernel reads the blocks
        (activations in float32; bfloat16 rows from QUANTIZED_BF16_ROWS to QUANTIZED_BF16_DEQUANT_ROWS
        multiply in bfloat16, exact codes, where the CPU has it).
        More rows, or no kernels: the weight dequantized for the call and a float matrix product, in
        bfloat16 for a bfloat16 model on a CPU with native bf16 (oneDNN, about twice float32's rate
        there; the weight rounded once per call), else in float32."""
        q = self._quantized
        assert q is not None
        flat = x.reshape(-1, self.in_features)
        if self._kernels is None:
            y = F.linear(flat.to(torch.float32), q.dequantize())
        elif q.packed:
            y = self._kernels.linear_qp(flat.contiguous(), q.blocks, q.code, q.out_features)
        elif (QUANTIZED_BF16_ROWS <= flat.shape[0] < QUANTIZED_BF16_DEQUANT_ROWS and x.dtype == torch.bfloat16
              and self._kernels.has_avx512bf16):
            y = self._kernels.linear_q_bf16(flat.contiguous(), q.blocks, q.code, q.out_features)
        elif flat.shape[0] < QUANTIZED_GEMV_ROWS:
            y = self._kernels.linear_q(flat.to(torch.float32).contiguous(), q.blocks, q.code, q.out_features)
        else:
            weight = self._kernels.dequantize_q(q.ggml_blocks(), q.code, q.out_features, q.in_features)
            if x.dtype == torch.bfloat16 and cpu_kernels.cpu_has_native_bf16():
                y = F.linear(flat, weight.to(torch.bfloat16))
            else:
                y = F.linear(flat.to(torch.float32), weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul: the output rows are the shards' rows
    one after the other (q|k|v, gate|up, ...). Checkpoints store each shard as its own tensor; the
    weight loader writes shard ``i`` at :meth:`shard_offset` (see each model's
    ``packed_modules_mapping``)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def shard_offset(self, shard: int) -> int:
        return sum(self.output_sizes[:shard])


class PackedEmbedding(nn.Module):
    """The token embedding of a model whose head is tied to it, looked up in the head's packed
    weight (oneDNN's layout, or float32 panels): the matrix is held once."""

    def __init__(self, head: Linear) -> None:
        super().__init__()
        self.head = [head]  # a list: not registered as a submodule (the model already holds it)
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head[0].weight_rows(input_ids)


class QuantizedEmbedding(nn.Module):
    """The token embedding of a model whose quantized head is tied to it: rows are dequantized from
    the head's blocks as they are looked up, so the matrix is held once, quantized."""

    def __init__(self, head: Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # a list: not registered as a submodule (the model already holds it)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        quantized = self.head[0]._quantized
        assert quantized is not None
        return quantized.rows(input_ids).to(self.dtype)


def prepare_for_inference(model: nn.Module, quantization: str | None = None) -> None:
    """Give every ``Linear`` its fast path; call after the weights are loaded (and never train).

    A head tied to the token embedding is packed like any layer when our kernel can read the
    packed layout; the embedding then looks rows up in it (``PackedEmbedding``), so the shared
    matrix is held once. ``quantization`` (q4_1, q8_0): every linear layer holds its weight as
    blocks of that format instead (the head as Q8_0), a tied embedding looking rows up in the head's."""
    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    tied = isinstance(head, Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight
    if quantization is not None:
        _quantize_linears(model, quantization, head if isinstance(head, Linear) else None, tied)
        return
    keep_plain = os.environ.get("TOKENLINE_KEEP_PLAIN_WEIGHTS", "0") == "1"
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare_for_inference(keep_plain=keep_plain or (tied and module is head))
    if tied and not keep_plain and head.has_readable_packed_copy():
        model.embed_tokens = PackedEmbedding(head)
        head.register_parameter("weight", None)


def _quantize_linears(model: nn.Module, fmt: str, head: Linear | None, tied: bool) -> None:
    dtype = head.weight.dtype if head is not None and head.weight is not None else torch.float32
    for module in model.modules():
        if isinstance(module, Linear):
            module.quantize_(HEAD_FORMAT if module is head else fmt)
    if tied and head is not None and head._quantized is not None:
        model.embed_tokens = QuantizedEmbedding(head, dtype)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul; GeGLU with
    ``activation="gelu_pytorch_tanh"`` (Gemma: tanh-approximated GELU in place of silu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"MLP activation {activation!r} is not supported")
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation != "silu":
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu" and gate_up.is_contiguous():
            kernels = cpu_kernels.load()
            if kernels is not None:
                return self.down_proj(kernels.silu_mul_bf16(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """Softmax self-attention over the paged KV cache, for every model.

    q, k and v come from one fused projection. Options cover the families we serve: a per-head
    ``qk_norm`` before RoPE (Qwen3 plain, Qwen3.5 and Gemma 3 zero-centred), partial RoPE (cos/sin
    narrower than a head), an ``output_gate``, where q_proj yields [query | gate] per head and the
    output is ``o_proj(attn * sigmoid(gate))`` (Qwen3.5), a sliding ``window`` (the last ``window``
    positions, its own included) and a score ``scale`` other than 1/sqrt(head_dim) (Gemma 3).
    """

    def __init__(
        self, config: ModelConfig, *, qk_norm: type[RMSNorm] | None = None, output_gate: bool = False,
        window: int | None = None, scale: float | None = None,
    ) -> None:
        super().__init__()
        self.window = window
        self.scale = scale
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.output_gate = output_gate
        # With the output gate, q_proj yields [query | gate] per head: twice the query width.
        self.q_width = self.num_heads * self.head_dim * (2 if output_gate else 1)
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.q_width, self.kv_size, self.kv_size], bias=config.attention_bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self, x: torch.Tensor, cos_sin: RotaryRows, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Plain q|k|v rows with full rotary: the CPU kernel rotates q and k in place inside the
        # fused projection, one pass and no temporaries. A norm or a gate between the projection
        # and RoPE rules that out.
        fused = self.q_norm is None and not self.output_gate and cos_sin[0].shape[-1] == self.head_dim
        kernels = cpu_kernels.load() if fused and qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu" else None
        if kernels is not None:
            kernels.rotary_bf16_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *cos_sin)
        q, k, v = qkv.split([self.q_width, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, -1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kernels is None:
            q, k = apply_rotary(q, k, cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.window, self.scale).flatten(1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

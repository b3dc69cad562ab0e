"""Decoder building blocks: RMSNorm, rotary position embedding, the SwiGLU MLP.

The maths follows the HF reference operation for operation (same dtypes at the same points), so
greedy outputs match it token for token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenline.model import cpu_kernels

# Up to this many rows (decode batches), our streaming kernel beats oneDNN on CPU bfloat16.
SMALL_BATCH_ROWS = 2
# The batch size oneDNN lays packed weights out for; any batch size still works with them.
PACKED_BATCH_HINT = 32


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.bfloat16 and x.device.type == "cpu" and self.weight.dtype == dtype:
            kernels = cpu_kernels.load()
            if kernels is not None:
                return kernels.rms_norm_bf16(x, self.weight, self.eps)
        # Normalise in float32 whatever the activation dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half layout) to query and key rows at given positions."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # One table of cos|sin per position, built once; each step only indexes it.
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for a step's positions, [T, 1, head_dim]; looked up once per step."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, heads, head_dim] and k [T, kv_heads, head_dim]."""
    cos, sin = cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Linear(nn.Linear):
    """``nn.Linear`` that, once :meth:`prepare_for_inference` ran, takes the fastest CPU path.

    bfloat16 on CPU: a handful of rows (a decode step) goes through our weight-streaming kernel,
    anything larger through oneDNN with the weight packed once at load time (plain ``F.linear``
    re-lays it out on every call). Other dtypes and devices use ``F.linear`` unchanged, so
    float32 stays bit-identical to the reference.
    """

    _kernels: cpu_kernels.CpuKernels | None = None
    _packed: torch.Tensor | None = None

    def prepare_for_inference(self) -> None:
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return
        self._kernels = cpu_kernels.load() if self.bias is None else None
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
            return self._kernels.linear_bf16(x.contiguous(), self.weight)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepare_for_inference(model: nn.Module) -> None:
    """Give every ``Linear`` its fast path; call after the weights are loaded (and never train)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare_for_inference()


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

"""Qwen3 (dense) for batched serving: Llama plus a per-head RMSNorm on queries and keys before RoPE.

The q/k norms are the plain Llama RMSNorm (weight times the normalised activations cast back), not
Qwen3.5's zero-centred ``1 + w`` variant. Sliding-window layers are not supported; Qwen3 configs
ship with ``use_sliding_window: false``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenline.model.attention import AttentionMetadata, paged_attention
from tokenline.model.config import ModelConfig
from tokenline.model.layers import RMSNorm, apply_rotary
from tokenline.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta)
        return self.o_proj(out.flatten(1))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.self_attn = Qwen3Attention(config)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same interface, cache layout and weight names as :class:`LlamaForCausalLM` (plus q_norm/k_norm)."""

    def __init__(self, config: ModelConfig) -> None:
        raw = getattr(config, "raw", None) or {}
        if raw.get("use_sliding_window"):
            raise ValueError("Qwen3 with use_sliding_window is not supported")
        super().__init__(config)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers))

"""Qwen3.5 hybrid decoder (Gated DeltaNet + gated full attention) for batched serving.

Layers follow ``layer_types``: ``linear_attention`` layers are Gated DeltaNets
(:mod:`tokenline.model.gated_deltanet`) whose memory is a fixed-size state per sequence, kept in
state slots; ``full_attention`` layers are the shared softmax attention over the paged KV cache,
with QK-norm, partial RoPE and a sigmoid output gate. One forward takes the same flat batch as
Llama (decode tokens first, one per sequence, then prefill spans) with its ``AttentionMetadata``.

What differs from Llama (checked against the HF reference):

- Decoder norms, final norm and q/k norms are zero-centred RMSNorms: ``norm(x) * (1 + w)``,
  multiplied in float32 *before* the cast back (Llama casts first, then multiplies by ``w``).
- Full attention: ``q_proj`` yields per head [query | gate]; output ``o_proj(attn * sigmoid(gate))``.
  RoPE rotates only the first ``partial_rotary_factor * head_dim`` dims of each head. The M-RoPE
  sections of the multimodal models collapse to plain RoPE for text, where the temporal, height
  and width positions are all the token position.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenline.model.attention import AttentionMetadata, allocate_kv_cache
from tokenline.model.config import ModelConfig
from tokenline.model.decoder import DecoderLM
from tokenline.model.gated_deltanet import DeltaNetShape, GatedDeltaNet
from tokenline.model.interface import Cache
from tokenline.model.layers import Attention, GatedMLP, RotaryRows, ZeroCenteredRMSNorm

LINEAR = "linear_attention"
FULL = "full_attention"


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config)
        elif layer_type == FULL:
            gated = bool(config.raw.get("attn_output_gate", True))
            self.self_attn = Attention(config, qk_norm=ZeroCenteredRMSNorm, output_gate=gated)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: RotaryRows,
        cache: Cache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, positions, cache, meta)
        else:
            h = self.self_attn(h, cos_sin, cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(DecoderLM):
    """The Qwen3.5 text model. ``caches`` (from :meth:`make_caches`) hold one entry per layer."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),  # [query | gate] per head
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    norm_class = ZeroCenteredRMSNorm

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return Qwen3_5DecoderLayer(config, config.layer_types[index])

    @classmethod
    def rotary_dim(cls, config: ModelConfig) -> int:
        rope = config.raw.get("rope_parameters") or config.raw.get("rope_scaling") or {}
        # 0.25 is what the reference assumes when a config does not say.
        partial = float(rope.get("partial_rotary_factor", config.raw.get("partial_rotary_factor", 0.25)))
        return int(config.head_dim * partial)

    # -- cache layout ------------------------------------------------------------------------------

    @classmethod
    def state_bytes_per_sequence(cls, config: ModelConfig, dtype_size: int) -> int:
        if not config.num_linear_attention_layers:
            return 0
        return config.num_linear_attention_layers * DeltaNetShape.from_config(config).state_bytes(dtype_size)

    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device
    ) -> list[Cache]:
        """Per layer: a paged KV tensor (full attention) or (conv_state, recurrent_state) slots (DeltaNet)."""
        c = self.config
        return [
            layer.linear_attn.make_state(num_state_slots, dtype, device)
            if layer.layer_type == LINEAR
            else allocate_kv_cache(num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype, device)
            for layer in self.layers
        ]

    # -- weights -----------------------------------------------------------------------------------

    def checkpoint_name(self, name: str) -> str | None:
        """Text-only and multimodal checkpoints alike: the text model's weights, relative to it."""
        if name.startswith("model.language_model."):
            return name.removeprefix("model.language_model.")
        if name.startswith(("model.visual.", "visual.", "mtp.")):
            return None  # the vision tower and the multi-token-prediction head: not part of text decoding
        return name.removeprefix("model.")

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

The checkpoints also carry a multi-token-prediction (MTP) head under ``mtp.*``; it is built and
loaded only for ``--speculative mtp`` (:meth:`Qwen3_5ForCausalLM.enable_mtp`,
:class:`MultiTokenPredictor`).
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
from tokenline.model.layers import Attention, GatedMLP, Linear, RotaryRows, ZeroCenteredRMSNorm
from tokenline.model.mtp_checkpoint import mtp_num_layers

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


class MultiTokenPredictor(nn.Module):
    """Qwen3.5's MTP head: from the target's hidden state at position p and the token at p + 1, a
    hidden state that predicts the token at p + 2 through the shared LM head.

    The token's embedding and the hidden state are normed separately (zero-centred norms),
    concatenated as [embedding | hidden], projected back to the hidden size by ``fc``, then go
    through one full-attention decoder layer with its own paged KV and the head's final norm. Fed
    its own output, it drafts further tokens (step i uses layer ``i % num_layers``).
    """

    def __init__(self, config: ModelConfig, num_layers: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, FULL) for _ in range(num_layers))
        self.norm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: RotaryRows,
        caches: list[Cache],
        meta: AttentionMetadata,
        step: int = 0,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        index = step % len(self.layers)
        return self.norm(self.layers[index](x, positions, cos_sin, caches[index], meta))


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

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.mtp: MultiTokenPredictor | None = None  # built by enable_mtp

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return Qwen3_5DecoderLayer(config, config.layer_types[index])

    @classmethod
    def rotary_dim(cls, config: ModelConfig) -> int:
        rope = config.raw.get("rope_parameters") or config.raw.get("rope_scaling") or {}
        # 0.25 is what the reference assumes when a config does not say.
        partial = float(rope.get("partial_rotary_factor", config.raw.get("partial_rotary_factor", 0.25)))
        return int(config.head_dim * partial)

    # -- multi-token prediction (speculative decoding from the model's own head) -------------------

    def enable_mtp(self) -> None:
        """Build the MTP head (before the weights load: they must then include ``mtp.*``)."""
        num_layers = mtp_num_layers(self.config)
        if not num_layers:
            raise ValueError("this model's config has no MTP head (mtp_num_hidden_layers is 0 or absent)")
        self.mtp = MultiTokenPredictor(self.config, num_layers)

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        caches: list[Cache],
        meta: AttentionMetadata,
        step: int = 0,
    ) -> torch.Tensor:
        """The MTP head's hidden states [T, hidden] for tokens ``input_ids`` (at p + 1) after the
        hidden states ``hidden`` (at p, the target's or the head's own), attending at ``positions`` p."""
        assert self.mtp is not None
        embeds = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, embeds.dtype)
        return self.mtp(embeds, hidden, positions, cos_sin, caches, meta, step)

    def make_mtp_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> list[Cache]:
        """The MTP layers' paged KV: the same blocks (and block tables) as the text model's."""
        c = self.config
        layers = len(self.mtp.layers) if self.mtp is not None else 0
        return [
            allocate_kv_cache(num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype, device)
            for _ in range(layers)
        ]

    # -- cache layout ------------------------------------------------------------------------------

    @classmethod
    def state_bytes_per_sequence(cls, config: ModelConfig, dtype_size: int) -> int:
        if not config.num_linear_attention_layers:
            return 0
        return config.num_linear_attention_layers * DeltaNetShape.from_config(config).state_bytes(dtype_size)

    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ) -> list[Cache]:
        """Per layer: a paged KV tensor (full attention) or (conv_state, recurrent_state) slots (DeltaNet)."""
        c = self.config
        return [
            layer.linear_attn.make_state(num_state_slots, dtype, device)
            if layer.layer_type == LINEAR
            else allocate_kv_cache(num_blocks, block_size, c.num_key_value_heads, c.head_dim, kv_dtype or dtype, device)
            for layer in self.layers
        ]

    # -- weights -----------------------------------------------------------------------------------

    def checkpoint_name(self, name: str) -> str | None:
        """Text-only and multimodal checkpoints alike: the text model's weights, relative to it."""
        if name.startswith("model.language_model."):
            return name.removeprefix("model.language_model.")
        if name.startswith("mtp."):
            return name if self.mtp is not None else None  # the MTP head: only for --speculative mtp
        if name.startswith(("model.visual.", "visual.")):
            return None  # the vision tower: not part of text decoding
        return name.removeprefix("model.")

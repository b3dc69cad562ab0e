"""Gemma 3 (text) for batched serving: a hybrid of sliding-window and global attention layers.

Five of every six layers attend to the last ``sliding_window`` positions (RoPE base 10k), every
sixth to all of them (RoPE base 1M, stretched linearly in the larger checkpoints): each kind gets
its own cos/sin per step. Beyond Llama: zero-centred ``(1 + w)`` RMSNorms everywhere (q/k norms
too), four per layer (before and after attention and the MLP), GeGLU with tanh GELU, embeddings
scaled by sqrt(hidden) in the model dtype, and scores scaled by ``query_pre_attn_scalar``.
Small steps run each layer as one C call (DecoderLM._fused_decode), these parts as the kernel's options.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from tokenline.model.attention import AttentionMetadata
from tokenline.model.config import ModelConfig
from tokenline.model.decoder import DecoderLM
from tokenline.model.interface import Cache
from tokenline.model.cpu_kernels import DecodeLayerWeights
from tokenline.model.layers import Attention, GatedMLP, RotaryEmbedding, RotaryRows, ZeroCenteredRMSNorm
from tokenline.model.llama import decode_layer_weights

SLIDING = "sliding_attention"


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        sliding = config.layer_types[index] == SLIDING
        self.sliding = sliding
        eps, hidden = config.rms_norm_eps, config.hidden_size
        scalar = config.raw.get("query_pre_attn_scalar") or config.head_dim
        self.self_attn = Attention(config, qk_norm=ZeroCenteredRMSNorm, window=config.sliding_window if sliding else None,
                                   scale=float(scalar) ** -0.5)
        self.mlp = GatedMLP(hidden, config.intermediate_size, activation=config.raw.get("hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: RotaryRows,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def decode_weights(self) -> DecodeLayerWeights | None:
        """This layer for the one-call decode kernel (cpu_kernels.decode_layer_): its four norms
        folded to float32 ``1 + w``, q/k norms, GELU and score scale as the kernel's options."""
        return decode_layer_weights(self.self_attn, self.mlp, self.input_layernorm, self.pre_feedforward_layernorm,
                                    self.post_attention_layernorm, self.post_feedforward_layernorm)


def rope_per_layer_type(config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """RoPE base and scaling of each layer type: from ``rope_parameters`` keyed by layer type
    (transformers 5), or the older ``rope_theta`` / ``rope_scaling`` (global) and
    ``rope_local_base_freq`` (sliding)."""
    raw = config.raw
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        found = {}
        for kind in ("full_attention", SLIDING):
            p = dict(params.get(kind) or params["full_attention"])
            theta = float(p.pop("rope_theta", 10000.0))
            found[kind] = (theta, None if p.get("rope_type", "default") == "default" else p)
        return found
    return {
        "full_attention": (config.rope_theta, config.rope_scaling),
        SLIDING: (float(raw.get("rope_local_base_freq", 10000.0)), None),
    }


class Gemma3ForCausalLM(DecoderLM):
    norm_class = ZeroCenteredRMSNorm
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.raw.get(key) is not None:
                raise ValueError(f"Gemma 3 with {key} is not supported")
        if config.raw.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
        if SLIDING in config.layer_types and not config.sliding_window:
            raise ValueError("Gemma 3 config has sliding_attention layers but no sliding_window")
        super().__init__(config)
        ropes = rope_per_layer_type(config)
        self.rotaries = {kind: RotaryEmbedding(config.head_dim, theta, scaling) for kind, (theta, scaling) in ropes.items()}
        # HF keeps sqrt(hidden) as a float32 scalar and casts it to the weights' dtype.
        self.embed_scale = float(np.float32(config.hidden_size**0.5))

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return Gemma3DecoderLayer(config, index)

    def layer_rotary(self, index: int) -> RotaryEmbedding:
        return self.rotaries[SLIDING if self.layers[index].sliding else "full_attention"]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Cache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        fused = self._fused_decode(x, positions, caches, meta)
        if fused is not None:
            return self.norm(fused)
        cos_sin = {kind: rotary.lookup(positions, x.dtype) for kind, rotary in self.rotaries.items()}
        for index, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            kind = SLIDING if layer.sliding else "full_attention"
            x = layer(x, positions, cos_sin[kind], cache, self.layer_meta(index, meta))
        return self.norm(x)

    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ) -> list[Cache]:
        """A paged KV tensor per layer slot of the KV cache groups (no state slots): the layers at one
        slot of different groups share it, as a block id belongs to one group at a time."""
        caches = self.paged_kv_caches(num_blocks, block_size, kv_dtype or dtype, device)
        return [caches[i] for i in range(self.config.num_hidden_layers)]

"""Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window) for batched serving.

One forward takes a flat batch of tokens from many sequences, prefill chunks and decode tokens
mixed, with their positions and an ``AttentionMetadata`` that locates each sequence's KV cache.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenline.model.attention import AttentionMetadata, allocate_kv_cache
from tokenline.model.config import ModelConfig
from tokenline.model.interface import Cache, CausalLM
from tokenline.model.layers import Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding, RotaryRows


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: Attention | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention or Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self, x: torch.Tensor, cos_sin: RotaryRows, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    @staticmethod
    def make_layer(config: ModelConfig) -> nn.Module:
        """One decoder layer; variants of the family override this alone."""
        return LlamaDecoderLayer(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Cache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device
    ) -> list[Cache]:
        """One paged KV tensor per layer (no state slots)."""
        c = self.config
        return [
            allocate_kv_cache(num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype, device)
            for _ in range(c.num_hidden_layers)
        ]

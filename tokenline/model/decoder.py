"""The trunk the decoders we serve share: token embeddings, a stack of decoder layers, a final norm
and the LM head, with RoPE's cos/sin computed once per step for all layers.

A model subclasses :class:`DecoderLM` and says how to build layer ``i``; where the family differs
it also sets the norm class and the rotary width. Every layer is called the same way,
``layer(x, positions, cos_sin, cache, meta) -> x``, whatever mixes its tokens (attention over the
paged KV cache, a recurrent layer over its state slot).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from tokenline.model.attention import AttentionMetadata
from tokenline.model.config import ModelConfig
from tokenline.model.interface import Cache, CausalLM
from tokenline.model.layers import Linear, RMSNorm, RotaryEmbedding


class DecoderLM(CausalLM):
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm  # the final norm's kind

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(self.rotary_dim(config), config.rope_theta, config.rope_scaling)

    @abstractmethod
    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        """Decoder layer ``index``."""

    @classmethod
    def rotary_dim(cls, config: ModelConfig) -> int:
        """How many leading dims of each head RoPE rotates: all of them unless the family says otherwise."""
        return config.head_dim

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Cache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, positions, cos_sin, cache, meta)
        return self.norm(x)

"""Qwen3 (dense) for batched serving: Llama plus a per-head RMSNorm on queries and keys before RoPE.

The q/k norms are the plain Llama RMSNorm (weight times the normalised activations cast back), not
Qwen3.5's zero-centred ``1 + w`` variant. Sliding-window layers are not supported; Qwen3 configs
ship with ``use_sliding_window: false``.
"""

from __future__ import annotations

from torch import nn

from tokenline.model.config import ModelConfig
from tokenline.model.layers import Attention, RMSNorm
from tokenline.model.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same interface, cache layout and weight names as :class:`LlamaForCausalLM` (plus q_norm/k_norm)."""

    def __init__(self, config: ModelConfig) -> None:
        if config.raw.get("use_sliding_window"):
            raise ValueError("Qwen3 with use_sliding_window is not supported")
        super().__init__(config)

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(config, Attention(config, qk_norm=RMSNorm))

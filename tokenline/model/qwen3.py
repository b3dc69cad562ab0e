"""Qwen3 (dense) for batched serving: Llama plus a per-head RMSNorm on queries and keys before RoPE.

The q/k norms are the plain Llama RMSNorm (weight times the normalised activations cast back), not
Qwen3.5's zero-centred ``1 + w`` variant. Sliding-window layers (``use_sliding_window`` with
``layer_types``; released Qwen3 configs turn it off) are KV cache groups of their own
(model/kv_groups.py).
"""

from __future__ import annotations

from torch import nn

from tokenline.model.config import ModelConfig
from tokenline.model.layers import Attention, RMSNorm
from tokenline.model.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same interface, cache layout and weight names as :class:`LlamaForCausalLM` (plus q_norm/k_norm)."""

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(config, Attention(config, qk_norm=RMSNorm))

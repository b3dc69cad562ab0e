"""Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window) for batched serving.

One forward takes a flat batch of tokens from many sequences, prefill chunks and decode tokens
mixed, with their positions and an ``AttentionMetadata`` that locates each sequence's KV cache.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenline.model.attention import AttentionMetadata
from tokenline.model.cpu_kernels import BF16_PACKED, DecodeLayerWeights
from tokenline.model.config import ModelConfig
from tokenline.model.decoder import DecoderLM
from tokenline.model.interface import Cache
from tokenline.model.layers import Attention, GatedMLP, RMSNorm, RotaryRows, ZeroCenteredRMSNorm


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: Attention | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention or Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: RotaryRows,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_weights(self) -> DecodeLayerWeights | None:
        """This layer's weights for the one-call decode kernel (cpu_kernels.decode_layer_), or None
        where it cannot run there (see :func:`decode_layer_weights`)."""
        return decode_layer_weights(self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm)


def decode_layer_weights(
    attn: Attention, mlp: GatedMLP, input_norm: RMSNorm, mlp_norm: RMSNorm,
    post_attn_norm: RMSNorm | None = None, post_ff_norm: RMSNorm | None = None,
) -> DecodeLayerWeights | None:
    """A decoder layer's weights for the one-call decode kernel (cpu_kernels.decode_layer_): the Llama
    layer (``input_norm`` before attention, ``mlp_norm`` before the MLP) or Gemma 3's, with norms after
    attention and the MLP, zero-centred norms (folded to float32 ``1 + w`` here, once), q/k norms,
    GELU and its score scale. None where the layer has what the kernel lacks (plain q/k norms, an
    output gate, biases) or its weights are none of: float32 CPU tensors, quantized blocks of one
    format (in a float32 or bfloat16 model), or bfloat16 weights every one of which sits in oneDNN's
    packed layout we read."""
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    all_norms = [n for n in (input_norm, mlp_norm, post_attn_norm, post_ff_norm, attn.q_norm, attn.k_norm) if n is not None]
    zero_centred = isinstance(input_norm, ZeroCenteredRMSNorm)
    if (attn.output_gate or any(lin.bias is not None for lin in linears)
            or len({type(n) for n in all_norms}) != 1 or (attn.q_norm is not None and not zero_centred)
            or any(n.eps != input_norm.eps for n in all_norms)):
        return None

    def weight(norm: RMSNorm | None) -> torch.Tensor | None:  # as the kernel scales by it
        if norm is None:
            return None
        return (1.0 + norm.weight.float()).detach().contiguous() if zero_centred else norm.weight.detach()

    raw = (input_norm.weight, mlp_norm.weight)
    norms = (weight(input_norm), weight(mlp_norm))
    quantized = [lin._quantized for lin in linears]
    if any(n.weight.device.type != "cpu" for n in all_norms):
        return None
    blocking, bf16_rows, packed = None, False, False
    if all(t.dtype == torch.bfloat16 for t in raw) and all(q is None for q in quantized):
        # A bfloat16 model: the packed tiles our small-batch kernel reads, each with its layout.
        packed = [lin._packed for lin in linears]
        if any(p is None or p.layout is None or lin.weight is not None for p, lin in zip(packed, linears)):
            return None
        matrices, fmt = [p.tiles for p in packed], BF16_PACKED  # type: ignore[union-attr]
        blocking = torch.tensor([v for p in packed for v in (p.layout.block_n, p.layout.pairs)],  # type: ignore[union-attr]
                                dtype=torch.int64)
    elif any(t.dtype != torch.float32 for t in raw):
        # A bfloat16 model with quantized projections runs in float32 here (the norms widened, exactly).
        if any(q is None for q in quantized) or len({(q.fmt, q.packed) for q in quantized}) != 1:  # type: ignore[union-attr]
            return None
        norms = tuple(t.float() for t in norms)  # type: ignore[union-attr]
        matrices, fmt = [q.blocks for q in quantized], quantized[0].code  # type: ignore[union-attr]
        bf16_rows = True
        packed = quantized[0].packed  # type: ignore[union-attr]
    elif all(q is None for q in quantized):
        panels = [lin.float32_panels() for lin in linears]
        if any(t is None for t in panels):
            return None
        matrices, fmt = panels, 0
    elif len({(q.fmt, q.packed) if q else None for q in quantized}) == 1:  # one format and layout, every projection
        matrices, fmt = [q.blocks for q in quantized if q is not None], quantized[0].code  # type: ignore[union-attr]
        packed = quantized[0].packed  # type: ignore[union-attr]
    else:
        return None
    ln1, ln2, qkv, o, gate_up, down = (t.detach().contiguous() for t in (*norms, *matrices))  # type: ignore[union-attr]
    extras = [weight(n) for n in (attn.q_norm, attn.k_norm, post_attn_norm, post_ff_norm)]
    if zero_centred or fmt != BF16_PACKED:  # float32 norms beside float32 rows, or a zero-centred layer's
        extras = [None if t is None else t.float().contiguous() for t in extras]
    return DecodeLayerWeights(ln1, qkv, o, ln2, gate_up, down, input_norm.eps, attn.num_heads,
                              attn.num_kv_heads, attn.head_dim, mlp.intermediate_size, fmt, blocking,
                              bf16_rows, packed, *extras, gelu=mlp.activation != "silu", scale=attn.scale,
                              f32_norms=zero_centred and fmt == BF16_PACKED)


class LlamaForCausalLM(DecoderLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(config)

    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ) -> list[Cache]:
        """One paged KV tensor per layer (no state slots); shared across KV cache groups with sliding layers."""
        caches = self.paged_kv_caches(num_blocks, block_size, kv_dtype or dtype, device)
        return [caches[i] for i in range(self.config.num_hidden_layers)]

"""Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window) for batched serving.

One forward takes a flat batch of tokens from many sequences, prefill chunks and decode tokens
mixed, with their positions and an ``AttentionMetadata`` that locates each sequence's KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenline.model import cpu_kernels
from tokenline.model.attention import AttentionMetadata, paged_attention
from tokenline.model.config import ModelConfig
from tokenline.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        kernels = cpu_kernels.load() if qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu" else None
        if kernels is not None:
            # Rotate q and k in place inside the fused projection: one pass, no temporaries.
            kernels.rotary_bf16_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *cos_sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if kernels is None:
            q, k = apply_rotary(q, k, cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta)
        return self.o_proj(out.flatten(1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """One paged KV tensor per layer. The torch decode path reads padded rows of unused slots,
        where garbage could be NaN, so it needs zeros; the C kernel reads only written slots, so
        its pool stays untouched (not resident) until sequences fill it."""
        c = self.config
        shape = (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        reads_only_written = torch.device(device).type == "cpu" and cpu_kernels.load() is not None
        alloc = torch.empty if reads_only_written else torch.zeros
        return [alloc(shape, dtype=dtype, device=device) for _ in range(c.num_hidden_layers)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("rotary_emb.") or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, offset = _fused_target(name, self.config)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            with torch.no_grad():
                param.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            loaded.add(f"{target}@{offset}")
        expected = _expected_pieces(self)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")


def _fused_target(name: str, config: ModelConfig) -> tuple[str, int]:
    """Map an HF weight name onto our (possibly fused) parameter and the row offset inside it."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    fused = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", q_size),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", q_size + kv_size),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
        "mlp.up_proj.": ("mlp.gate_up_proj.", config.intermediate_size),
    }
    for piece, (target, offset) in fused.items():
        if piece in name:
            return name.replace(piece, target), offset
    return name, 0


def _expected_pieces(model: LlamaForCausalLM) -> set[str]:
    config = model.config
    names = {name for name, _ in model.named_parameters()}
    pieces = set()
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    for name in names:
        if "qkv_proj" in name:
            pieces |= {f"{name}@0", f"{name}@{q_size}", f"{name}@{q_size + kv_size}"}
        elif "gate_up_proj" in name:
            pieces |= {f"{name}@0", f"{name}@{config.intermediate_size}"}
        else:
            pieces.add(f"{name}@0")
    return pieces

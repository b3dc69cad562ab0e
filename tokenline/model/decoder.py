"""The trunk the decoders we serve share: token embeddings, a stack of decoder layers, a final norm
and the LM head, with RoPE's cos/sin computed once per step for all layers.

A model subclasses :class:`DecoderLM` and says how to build layer ``i``; where the family differs
it also sets the norm class and the rotary width. Every layer is called the same way,
``layer(x, positions, cos_sin, cache, meta) -> x``, whatever mixes its tokens (attention over the
paged KV cache, a recurrent layer over its state slot).

A step of a few dozen tokens skips that: when every layer offers ``decode_weights()`` (Llama or
Gemma 3 layers: float32, quantized, or bfloat16 packed for oneDNN), each runs as one C call
(cpu_kernels.decode_layer_), since at batch 1 dispatching ~25 torch operators a layer costs as much
as reading its weights. Every token is a
decode query there (the runner's per-token tables of each layer's KV cache group,
AttentionMetadata.token_block_tables, with the group's window): a decode
row, or a token of a prefill chunk or of a draft run, attending up to its own position; the layer
writes all the step's K/V before any row attends.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from tokenline.model import cpu_kernels
from tokenline.model.attention import AttentionMetadata, allocate_kv_cache
from tokenline.model.batch import FUSED_DECODE_ROWS
from tokenline.model.config import ModelConfig
from tokenline.model.interface import Cache, CausalLM
from tokenline.model.kv_groups import layer_slots, layers_per_block
from tokenline.model.layers import Linear, RMSNorm, RotaryEmbedding, small_batch_rows


def _fused_decode_rows_default() -> int:
    """Decode batches up to this many rows take the one-call layer kernel; 0 turns it off."""
    rows = int(os.environ.get("TOKENLINE_FUSED_DECODE_ROWS", str(FUSED_DECODE_ROWS)))
    return max(0, min(rows, cpu_kernels.DECODE_LAYER_MAX_ROWS))


def bf16_fused_rows() -> int:
    """The most tokens a step of a bfloat16 model may have for its one-call layers, which multiply
    with our streaming kernel (tl_linear_bf16_blocked). Without AMX that beats the per-operator path
    at every step size up to FUSED_DECODE_ROWS (the default model, 2 threads: 0.72x its time at 1
    row, 0.57x at 8, 0.84x at 32 while that path still took oneDNN past 8 rows; docs/benchmarks); with AMX,
    where oneDNN multiplies on tiles, only up to the rows its own Linear streams
    (layers.small_batch_rows). Either way both paths then multiply alike: the same bits."""
    return small_batch_rows() if cpu_kernels.cpu_has_amx() else FUSED_DECODE_ROWS

# The kernels, every layer's weights as the fused kernel reads them, and one scratch buffer.
FusedLayers = tuple[cpu_kernels.CpuKernels, list[cpu_kernels.DecodeLayerWeights], torch.Tensor]


class DecoderLM(CausalLM):
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm  # the final norm's kind

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An explicit (uninitialised) weight: Embedding's own init calls normal_, which on the meta
        # device imports torch._dynamo, 3 of a cold start's ~6 s on the 2-core CPU here.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(self.rotary_dim(config), config.rope_theta, config.rope_scaling)
        # Attention layer -> (its KV cache group, the KV tensor it reads): model/kv_groups.py.
        self.kv_layer_slots = layer_slots(config)
        self.fused_decode_rows = _fused_decode_rows_default()
        # Built at the first eligible step (the weights are loaded by then): the kernels, each
        # layer's weights and a scratch buffer; False once found unavailable.
        self._fused_layers: FusedLayers | None | bool = None

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
        fused = self._fused_decode(x, positions, caches, meta)
        if fused is not None:
            return self.norm(fused)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for index, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            x = layer(x, positions, cos_sin, cache, self.layer_meta(index, meta))
        return self.norm(x)

    def layer_meta(self, index: int, meta: AttentionMetadata) -> AttentionMetadata:
        """The metadata layer ``index`` attends with: with several KV cache groups, its group's
        tables and window; with one, the step's."""
        return meta.groups[self.kv_layer_slots[index][0]] if meta.groups else meta

    def paged_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> dict[int, torch.Tensor]:
        """Attention layer index -> its paged KV tensor. The layers at the same slot of different
        KV cache groups share one tensor (a block id belongs to one group at a time); with one
        group, every layer has its own."""
        c = self.config
        tensors = [allocate_kv_cache(num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype, device)
                   for _ in range(layers_per_block(c))]
        return {layer: tensors[slot] for layer, (_, slot) in self.kv_layer_slots.items()}

    def _fused_decode(
        self, x: torch.Tensor, positions: torch.Tensor, caches: list[Cache], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Every layer through the one-call decode kernel, if this step and model allow it: the hidden
        states after the last layer (in x's dtype), else None. Float32 and quantized weights compute
        in float32 (a bfloat16 model's rows widened for them); oneDNN's packed bfloat16 tiles in
        bfloat16, rounding as the per-operator path does."""
        rows = x.shape[0]
        if (not 1 <= rows <= self.fused_step_tokens() or x.dtype not in (torch.float32, torch.bfloat16)
                or x.device.type != "cpu"):
            return None
        fused = self._fused_layers_or_none()
        assert fused is not None  # fused_step_tokens() > 0 says the layers are there
        kernels, weights, scratch = fused
        bf16 = weights[0].fmt == cpu_kernels.BF16_PACKED
        if bf16 and x.dtype != torch.bfloat16:
            return None
        # Each layer's rows: its KV cache group's per-token tables, slots and window, and its RoPE
        # table (Gemma 3's two bases); built once per (group, table) for the step.
        rotary_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        steps: dict[tuple[int, int], cpu_kernels.DecodeRows] = {}
        layer_rows: list[cpu_kernels.DecodeRows] = []
        for index in range(len(weights)):
            group, rotary = self.layer_meta(index, meta), self.layer_rotary(index)
            key = (id(group), id(rotary))
            if key not in steps:
                if (group.token_context_lens is None or group.token_block_tables is None
                        or group.token_context_lens.shape[0] != rows):
                    return None
                if id(rotary) not in rotary_rows:
                    cos, sin = (t.reshape(rows, -1).contiguous()
                                for t in rotary.lookup(positions, x.dtype if bf16 else torch.float32))
                    if cos.shape[-1] != weights[index].head_dim:  # partial rotary
                        return None
                    rotary_rows[id(rotary)] = (cos, sin)
                steps[key] = cpu_kernels.DecodeRows(*rotary_rows[id(rotary)], group.slot_mapping, group.token_block_tables,
                                                    group.token_context_lens, group.max_token_context_len, group.window)
            layer_rows.append(steps[key])
        # x itself when already in the kernel's dtype and contiguous (a fresh embedding lookup).
        hidden = (x if bf16 else x.to(torch.float32)).contiguous()
        for w, step, cache in zip(weights, layer_rows, caches, strict=True):
            kernels.decode_layer_(hidden, w, step, cache[0], cache[1], scratch)  # type: ignore[index]
        return hidden.to(x.dtype)

    def layer_rotary(self, index: int) -> RotaryEmbedding:
        """The RoPE table layer ``index`` rotates with: the model's one unless the family has several."""
        return self.rotary

    def fused_step_tokens(self) -> int:
        """The most tokens a step may have for the one-call decode layers to take it; 0 when this
        model's layers cannot run there (not Llama or Gemma 3 layers on CPU with float32, quantized or
        packed bfloat16 projections, or no kernels). The runner builds the per-token tables they
        read (each KV cache group's) only for such steps."""
        fused = self._fused_layers_or_none() if self.fused_decode_rows else None
        if fused is None:
            return 0
        bf16 = fused[1][0].fmt == cpu_kernels.BF16_PACKED
        return min(self.fused_decode_rows, bf16_fused_rows()) if bf16 else self.fused_decode_rows

    def _fused_layers_or_none(self) -> FusedLayers | None:
        if self._fused_layers is None:
            kernels = cpu_kernels.load()
            weights = [getattr(layer, "decode_weights", lambda: None)() for layer in self.layers]
            if kernels is None or not weights or any(w is None for w in weights):
                self._fused_layers = False
            else:
                for w in weights:
                    w.check()
                scratch = max(cpu_kernels.decode_layer_scratch(cpu_kernels.DECODE_LAYER_MAX_ROWS, w) for w in weights)
                self._fused_layers = (kernels, weights, torch.empty(scratch, dtype=torch.float32))
        return self._fused_layers or None

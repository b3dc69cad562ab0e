"""What every model implements, so that the runner, the loader, the registry and the memory plan
treat all architectures alike: forward, logits, cache layout and weight loading."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from tokenline.model.attention import AttentionMetadata
from tokenline.model.config import ModelConfig

# One layer's cache: a paged KV tensor (attention) or a sequence-slot state (e.g. (conv, recurrent)).
Cache = torch.Tensor | tuple[torch.Tensor, ...]


class CausalLM(nn.Module, ABC):
    """A decoder-only language model serving a flat batch of tokens from many sequences.

    Built from its :class:`ModelConfig` alone (the loader builds it on the meta device, then fills
    every parameter from the checkpoint), so a constructor must not compute anything from weights.
    """

    # Checkpoint module name -> (our merged module's name, shard index inside it), e.g.
    # ``"k_proj": ("qkv_proj", 1)``: the shared weight loader writes the checkpoint's k_proj tensor
    # into the second shard of our ``qkv_proj`` (a ``MergedLinear``). Names are whole dotted parts.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}

    config: ModelConfig
    embed_tokens: nn.Embedding
    lm_head: nn.Linear

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Cache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens (decode tokens first, then prefill spans)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fused_step_tokens(self) -> int:
        """The most tokens a step may have for a one-call layer kernel to take it, reading
        ``AttentionMetadata.token_block_tables``; 0 (the default) for a model without one."""
        return 0

    # -- cache layout: sizes from the config alone (the memory plan has no weights) -------------

    @classmethod
    def kv_bytes_per_token(cls, config: ModelConfig, dtype_size: int) -> int:
        """Bytes of paged KV one token occupies across the layers."""
        return config.kv_bytes_per_token(dtype_size)

    @classmethod
    def state_bytes_per_sequence(cls, config: ModelConfig, dtype_size: int) -> int:
        """Bytes of fixed-size per-sequence state (one state slot) across the layers; 0 for pure attention."""
        return 0

    @abstractmethod
    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ) -> list[Cache]:
        """One cache per layer: ``num_blocks`` paged KV blocks and ``num_state_slots`` state slots,
        whose sizes :meth:`kv_bytes_per_token` and :meth:`state_bytes_per_sequence` state. The KV is
        held in ``kv_dtype`` (default ``dtype``), states always in ``dtype``."""

    # -- multi-token prediction --------------------------------------------------------------------

    def enable_mtp(self) -> None:
        """Build the model's own draft head for ``--speculative mtp`` (families that have one override this)."""
        raise ValueError(f"{type(self).__name__} has no multi-token-prediction head")

    # -- weights ----------------------------------------------------------------------------------

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name relative to this model, or None for a tensor it does not use
        (read by ``weights.load_packed_weights``, the one loader of every model's checkpoint)."""
        return name.removeprefix("model.")

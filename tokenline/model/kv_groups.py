"""How a model's attention layers share the paged KV pool: KV cache groups.

Full-attention layers keep every token's KV; sliding-window layers need only the last ``window``
positions. Both kinds draw from ONE pool of equal-sized blocks (as vLLM's hybrid KV cache manager
does), so memory moves freely between them: the attention layers are cut into groups of equal
size ``G`` (the greatest common divisor of the two kinds' counts, so no layer slot is padding),
a block id holds ``block_size`` tokens of K/V for the ``G`` layers of whichever group holds it,
and each group has its own block table per sequence. A sliding group's table drops the blocks
its window can no longer see (the engine's KV cache manager), a full group's keeps them all.

Layer ``i`` of group ``g`` at slot ``s`` (its index inside the group) reads KV tensor ``s``: the
model allocates ``G`` tensors of ``num_blocks`` blocks. A model with one kind of attention layer
(Llama, the Qwen3.5 hybrid's attention layers) has one group holding all of them: what it was
before groups existed. No torch: the engine and the planner read this too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenline.model.config import ModelConfig

SLIDING = "sliding_attention"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # sliding groups: positions a query sees, itself included; None: full attention
    layers: tuple[int, ...]  # the model's layer indices, in order; the i-th reads KV tensor i


def kv_groups(config: ModelConfig) -> list[KVGroup]:
    """The model's KV cache groups: full-attention groups first, then sliding ones."""
    types = config.layer_types or ["full_attention"] * config.num_hidden_layers
    full = [i for i, t in enumerate(types) if t not in (SLIDING, LINEAR)]
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    if sliding and not config.sliding_window:
        raise ValueError("the config has sliding_attention layers but no sliding_window")
    size = math.gcd(len(full), len(sliding)) or 1
    groups = [KVGroup(None, tuple(full[i : i + size])) for i in range(0, len(full), size)]
    groups += [KVGroup(config.sliding_window, tuple(sliding[i : i + size])) for i in range(0, len(sliding), size)]
    return groups


def layers_per_block(config: ModelConfig) -> int:
    """Attention layers one pool block holds KV for (the group size)."""
    groups = kv_groups(config)
    return len(groups[0].layers) if groups else 0


def layer_slots(config: ModelConfig) -> dict[int, tuple[int, int]]:
    """Attention layer index -> (its group, its slot in the group: which KV tensor it reads)."""
    return {layer: (g, s) for g, group in enumerate(kv_groups(config)) for s, layer in enumerate(group.layers)}


def sliding_blocks_needed(window: int, block_size: int, num_query_tokens: int = 1) -> int:
    """The most blocks a sliding group holds for a sequence while ``num_query_tokens`` are computed
    in one step: the window's ``window - 1`` earlier positions plus the step's own, at any alignment."""
    return -(-(window - 1 + num_query_tokens) // block_size) + 1


def group_windows(config: ModelConfig) -> list[int | None]:
    """Per KV cache group, its window (None: full attention): the KV cache manager's ``group_windows``."""
    return [g.window for g in kv_groups(config)]


def kv_block_bytes(config: ModelConfig, kv_bytes_per_token: int, block_size: int) -> int:
    """Bytes of one pool block: ``block_size`` tokens of K/V for one group's layers, from
    ``kv_bytes_per_token`` over every attention layer (the engine's pool and the simulators' alike)."""
    groups = kv_groups(config)
    if len(groups) > 1:
        kv_bytes_per_token = kv_bytes_per_token * len(groups[0].layers) // config.num_full_attention_layers
    return kv_bytes_per_token * block_size

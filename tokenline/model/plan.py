"""Memory planning: the arithmetic an operator needs before buying a machine.

Weights from the model definition itself (built on the meta device, so even a 27B config costs no
memory), KV bytes per token (attention layers), fixed state bytes per sequence (linear-attention
layers), the state checkpoints that give hybrid models prefix caching, and how many sequences of a
given length fit in a budget. Sliding-window layers hold at most their window's blocks of a
sequence (engine/kv_cache_manager.py); the plan shows that beside every layer global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenline.model.config import ModelConfig
from tokenline.model.kv_groups import sliding_blocks_needed
from tokenline.model.loader import model_class

GIB = 1 << 30


@dataclass
class MemoryPlan:
    num_parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    seq_len: int
    bytes_per_sequence: int  # KV for seq_len tokens + the fixed state
    cache_budget_bytes: int  # memory left for KV and states after the weights
    max_sequences: int
    num_state_checkpoints: int = 0  # hybrid prefix caching: checkpoint slots, one state each
    state_checkpoint_bytes: int = 0
    # Sliding-window models: the sequence's KV as it is held, and as it would be with every layer global.
    kv_bytes_per_sequence: int = 0
    kv_bytes_per_sequence_all_global: int = 0
    sliding_tokens_held: int = 0  # tokens a sliding layer holds at most (its window's blocks)

    def format(self) -> str:
        rows = [
            ("parameters", f"{self.num_parameters:,}"),
            ("weights", _size(self.weight_bytes)),
            ("KV per token", f"{self.kv_bytes_per_token:,} B (attention layers, full and sliding)"),
            ("state per sequence", f"{self.state_bytes_per_sequence:,} B (linear-attention layers)"),
            *(
                [(f"KV of one sequence of {self.seq_len} tokens",
                  f"{_size(self.kv_bytes_per_sequence)}, sliding layers holding {self.sliding_tokens_held:,} tokens"),
                 ("  with every layer global", f"{_size(self.kv_bytes_per_sequence_all_global)} "
                  f"({self.kv_bytes_per_sequence_all_global / max(1, self.kv_bytes_per_sequence):.2f}x; the window "
                  f"saves {_size(self.kv_bytes_per_sequence_all_global - self.kv_bytes_per_sequence)})")]
                if self.sliding_tokens_held else []
            ),
            (f"one sequence of {self.seq_len} tokens", _size(self.bytes_per_sequence)),
            ("left for KV + states", _size(self.cache_budget_bytes)),
            *(
                [(f"{self.num_state_checkpoints} state checkpoints", f"{_size(self.state_checkpoint_bytes)} "
                  "(hybrid prefix caching)")]
                if self.num_state_checkpoints else []
            ),
            (f"sequences of {self.seq_len} tokens that fit", f"{self.max_sequences:,}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def count_parameters(config: ModelConfig) -> int:
    """Parameters of our implementation of the model (tied embeddings counted once)."""
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    return sum(p.numel() for p in model.parameters())  # parameters() already skips tied duplicates


def plan_memory(
    config: ModelConfig, memory_gib: float, seq_len: int, dtype_size: int = 2, num_state_checkpoints: int = 0,
    block_size: int = 16,
) -> MemoryPlan:
    """``num_state_checkpoints``: a hybrid model's checkpoint slots (``--hybrid-state-checkpoints``),
    each one sequence's state, taken from the cache budget before sequences are counted.
    ``block_size``: the KV block, what a sliding-window layer's holding is counted in."""
    params = count_parameters(config)
    weight_bytes = params * dtype_size
    cls = model_class(config.architecture)
    kv_per_token = cls.kv_bytes_per_token(config, dtype_size)
    state = cls.state_bytes_per_sequence(config, dtype_size)
    kv_all_global = kv_per_token * seq_len
    kv_held, sliding_held = kv_all_global, 0
    num_sliding = config.num_sliding_attention_layers
    if num_sliding and config.sliding_window:
        # The most a sliding layer holds while decoding: the window's blocks at the worst alignment.
        sliding_held = min(seq_len, sliding_blocks_needed(config.sliding_window, block_size) * block_size)
        per_layer_token = kv_per_token // config.num_full_attention_layers
        kv_held = kv_all_global - num_sliding * per_layer_token * (seq_len - sliding_held)
    per_sequence = kv_held + state
    budget = max(0, int(memory_gib * GIB) - weight_bytes)
    checkpoints = num_state_checkpoints if state else 0
    left = max(0, budget - checkpoints * state)
    return MemoryPlan(params, weight_bytes, kv_per_token, state, seq_len, per_sequence, budget, left // per_sequence,
                      checkpoints, checkpoints * state, kv_held, kv_all_global, sliding_held)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB ({num_bytes:,} B)"

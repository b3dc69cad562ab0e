"""Random token-id prompts for load runs (exact lengths, seeded, optionally sharing a prefix) and
the tokenizer they are drawn from."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def ordinary_token_ids(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """Ids a random prompt may use: every id below ``vocab_size`` that is not special."""
    special = set(special_ids)
    return [i for i in range(vocab_size) if i not in special]


def make_prompts(
    num_prompts: int,
    input_len: int,
    ordinary_ids: Sequence[int],
    seed: int,
    shared_prefix_len: int = 0,
) -> list[list[int]]:
    """``num_prompts`` lists of exactly ``input_len`` ids drawn from ``ordinary_ids``; each starts with
    the same ``shared_prefix_len`` ids (drawn first), and the same seed gives the same prompts."""
    if not ordinary_ids:
        raise ValueError("no ordinary token ids to draw from")
    rng = random.Random(seed)
    prefix = rng.choices(ordinary_ids, k=shared_prefix_len)
    return [prefix + rng.choices(ordinary_ids, k=input_len - shared_prefix_len) for _ in range(num_prompts)]


def load_tokenizer(tokenizer_dir: str | Path | None) -> Any:
    """The tokenizer in ``tokenizer_dir``, or the default model's."""
    from tokenline.frontend.tokenizer import Tokenizer
    from tokenline.store.model_store import resolve_model

    return Tokenizer.from_dir(tokenizer_dir if tokenizer_dir is not None else resolve_model(None))

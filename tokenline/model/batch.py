"""The scheduler's decision for one step, and what the runner hands back.

This is the whole contract between the engine (bookkeeping) and the model runner (tensors): the
runner sees token ids, positions, block ids and sampling settings, never a ``Request``. It lives
in the model package, the lower of the two, so the model never imports the engine that drives it;
and it stays torch-free at import time because the API process reads ``TokenLogprobs`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tokenline.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch

# Steps of up to this many tokens (decode rows, small prefill chunks, draft runs) run the one-call
# layer kernel (measured on the default model: docs/benchmarks, "Dispatch at small batches"). Here, not in
# the decoder, so the torch-free simulator prices the same boundary the engine takes.
FUSED_DECODE_ROWS = 64


@dataclass
class TokenLogprobs:
    """Log-probability of a token (generated, or a prompt token scored) and, when asked, the top
    alternatives at that position. ``rank``: the token's place in the vocabulary by probability
    (1 = the most likely), given for prompt tokens (vLLM's ``prompt_logprobs``)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: Sequence[int]  # the tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] (tokens before it are already in the KV cache)
    block_table: Sequence[int]  # the sequence's blocks, covering start_pos + len(token_ids)
    sample: bool  # True when this chunk ends at the last known token: sample the next one
    sampling: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    banned_token_ids: Sequence[int] = ()  # EOS / stop ids while fewer than min_tokens are out
    state_slot: int | None = None  # hybrid models: the slot holding its linear-attention state
    # Speculative decoding: guessed tokens after the last known one, already at the end of
    # token_ids. The runner then returns the greedy token at each of the 1 + k positions.
    draft_token_ids: Sequence[int] = ()
    # Hybrid models' prefix caching: a state slot (a checkpoint) to copy into ``state_slot`` before
    # this step, and (tokens into this chunk, slot) pairs: copy the state there after that many tokens.
    restore_state_from: int | None = None
    state_checkpoints: Sequence[tuple[int, int]] = ()
    # Structured output: int32 [1 + len(draft_token_ids), ceil(vocab / 32)], one row per sampled
    # position, bit i of a row set when token i is allowed there (structured_output/grammar.py); None: no constraint.
    grammar_bitmask: np.ndarray | None = None
    # A chunk that does not sample: the known token after it (a draft head, MTP, needs the token
    # after every position it reads).
    next_token_id: int | None = None
    # Prompt logprobs: the known tokens after the chunk's first len(...) positions, to be scored
    # from those positions' logits (the top sampling.prompt_logprobs beside each); the runner
    # answers in ScheduledBatch.prompt_logprobs.
    prompt_logprob_targets: Sequence[int] = ()
    # Models with several KV cache groups (sliding-window layers, model/kv_groups.py): every group's
    # table, block_table being the first; -1 where a sliding window let a block go. Empty otherwise.
    group_block_tables: Sequence[Sequence[int]] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def attention_pairs(self) -> int:
        """Query-key pairs this chunk's attention computes: its i-th token attends to start_pos + i + 1
        positions (a step's records and the simulator's step model price prefill attention by it)."""
        n = len(self.token_ids)
        return n * self.start_pos + n * (n + 1) // 2


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Filled by the runner: request id -> the scores of its ScheduledSeq.prompt_logprob_targets, in
    # order. Here rather than in the sampled tokens because a prompt chunk that samples nothing has them.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class SampledToken:
    token_id: int  # sampled after the last known token
    logprobs: TokenLogprobs | None = None
    # For a sequence with drafts: the greedy token after each draft (the model's own choice at
    # those positions), so [token_id, *draft_targets] is what it picks at each of the 1 + k.
    draft_targets: list[int] = field(default_factory=list)
    # With a draft head of the model's own (MTP): drafts to follow the tokens this step accepts
    # (the drafts it agreed with, then token_id / its own token after them), for the next step.
    next_draft_token_ids: list[int] = field(default_factory=list)


def num_accepted_drafts(drafts: Sequence[int], token: SampledToken) -> int:
    """How many leading drafts the model agrees with: greedy verification, an exact match with its
    own token at each position. The scheduler keeps those tokens; the runner keeps hybrid models'
    recurrent state after them (both from this one rule)."""
    targets = [token.token_id, *token.draft_targets]
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


class Runner(Protocol):
    """Anything that turns a scheduled batch into one sampled token per sampling sequence (plus,
    for a sequence with draft tokens, the greedy token after each draft)."""

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]: ...

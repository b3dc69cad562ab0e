"""Drafting with the model's own multi-token-prediction head (``--speculative mtp``).

Runs inside the runner's step, after the target forward and sampling, so it reads the target's
hidden states where they are. The MTP layer's KV entry at position p is computed from the target's
hidden state at p and the token at p + 1, so for every sequence of the step it first *catches up*
over the positions this step made final: the chunk's known tokens and the drafts the target
accepted, each with the token after it (the next one in the chunk, the target's own token at the
end, or for a chunk that does not sample the next prompt token). The last of those rows predicts
the first draft; each further draft feeds the head its own output and draft at the next position
(its KV there is overwritten by the catch-up once that position is real). Greedy verification by
the target keeps the output exact whatever the head proposes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from tokenline.model.attention import AttentionMetadata
from tokenline.model.batch import SampledToken, ScheduledSeq, num_accepted_drafts
from tokenline.model.interface import Cache

if TYPE_CHECKING:
    from tokenline.model.qwen3_5 import Qwen3_5ForCausalLM

PrepareFn = Callable[
    [list[ScheduledSeq]], tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[ScheduledSeq]]
]


class MtpDrafter:
    """Up to ``num_speculative_tokens`` drafts per sampling sequence and step from the MTP head."""

    def __init__(self, model: Qwen3_5ForCausalLM, num_speculative_tokens: int, vocab_size: int, prepare: PrepareFn) -> None:
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size  # drafts stay inside the tokenizer's ids (padded vocabularies)
        self.prepare = prepare  # the runner's flat-batch layout, reused for the head's batches
        self.caches: list[Cache] = []

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """The head's layers are full attention: each stores K and V for every token, like a text layer."""
        config = self.model.config
        assert self.model.mtp is not None
        return len(self.model.mtp.layers) * 2 * config.num_key_value_heads * config.head_dim * dtype_size

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.caches = self.model.make_mtp_caches(num_blocks, block_size, dtype, device)

    def draft(self, seqs: list[ScheduledSeq], hidden: torch.Tensor, sampled: dict[str, SampledToken]) -> None:
        """Catch the head's KV up over this step's final positions and fill each sampling
        sequence's ``next_draft_token_ids``. ``seqs`` in the flat batch's order, ``hidden`` its rows."""
        pseudo: list[ScheduledSeq] = []
        rows: list[torch.Tensor] = []
        start = 0
        for seq in seqs:
            if not seq.sampling.greedy:
                # A sampled (non-greedy) request never drafts (the scheduler's rule), so the head
                # needs no KV for it: skip it altogether.
                start += seq.num_tokens
                continue
            num_known = seq.num_tokens - len(seq.draft_token_ids)
            if seq.sample:
                token = sampled[seq.request_id]
                targets = [token.token_id, *token.draft_targets]
                new = targets[: num_accepted_drafts(seq.draft_token_ids, token) + 1]
            elif seq.next_token_id is not None:
                new = [seq.next_token_id]
            else:
                new = []  # nothing known after the chunk: its last position waits for a later step
            inputs = [*seq.token_ids[1:num_known], *new]
            if inputs:
                pseudo.append(replace(seq, token_ids=inputs, sample=seq.sample, draft_token_ids=(),
                                      state_checkpoints=(), restore_state_from=None, grammar_bitmask=None))
                rows.append(torch.arange(start, start + len(inputs), device=hidden.device))
            start += seq.num_tokens
        if not pseudo:
            return
        # The runner's layout puts one-token rows (decodes) first.
        order = sorted(range(len(pseudo)), key=lambda i: pseudo[i].num_tokens != 1)
        pseudo = [pseudo[i] for i in order]
        index = torch.cat([rows[i] for i in order])
        out, logits_rows, drafting = self._run(pseudo, hidden.index_select(0, index), step=0)
        if not drafting:
            return
        drafts: dict[str, list[int]] = {s.request_id: [] for s in drafting}
        last = out.index_select(0, logits_rows)
        for step in range(self.num_speculative_tokens):
            tokens = self._argmax(last)
            for seq, token_id in zip(drafting, tokens, strict=True):
                drafts[seq.request_id].append(token_id)
            if step + 1 == self.num_speculative_tokens:
                break
            # The next draft: the head on its own output and draft, one position on, while the
            # sequence's blocks cover that position (they are allocated for this step's tokens).
            following = []
            keep = []
            for i, (seq, token_id) in enumerate(zip(drafting, tokens, strict=True)):
                position = seq.start_pos + seq.num_tokens
                if position // self.block_size < len(seq.block_table):
                    following.append(replace(seq, token_ids=[token_id], start_pos=position))
                    keep.append(i)
            if not following:
                break
            hidden_in = last.index_select(0, torch.tensor(keep, dtype=torch.long, device=last.device))
            last, _, drafting = self._run(following, hidden_in, step=step + 1)
        for request_id, ids in drafts.items():
            sampled[request_id].next_draft_token_ids = ids

    def _run(
        self, pseudo: list[ScheduledSeq], hidden: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[ScheduledSeq]]:
        input_ids, positions, meta, logits_rows, drafting = self.prepare(pseudo)
        out = self.model.mtp_forward(input_ids, hidden, positions, self.caches, meta, step)
        return out, logits_rows, drafting

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.compute_logits(hidden)[:, : self.vocab_size]
        return logits.argmax(-1).tolist()

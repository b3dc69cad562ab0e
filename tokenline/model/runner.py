"""The model runner: turns a ``ScheduledBatch`` into tensors, runs the model, samples.

It owns the weights, the KV cache tensors and the sampler. The flat batch is laid out with the
decode tokens (one per sequence) first and prefill chunks after, so decode attention runs as one
batched call.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenline.model.attention import AttentionMetadata
from tokenline.model.batch import SampledToken, ScheduledBatch, ScheduledSeq, TokenLogprobs, num_accepted_drafts
from tokenline.model.config import ModelConfig
from tokenline.model.gated_deltanet import copy_state_slots
from tokenline.model.interface import Cache
from tokenline.model.kv_groups import group_windows, kv_block_bytes
from tokenline.model.loader import load_model
from tokenline.model.mtp_drafter import MtpDrafter
from tokenline.model.prefill_attention import PrefillSpan
from tokenline.model.prompt_logprobs import score_tokens
from tokenline.model.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        config: ModelConfig | None = None,
        mtp_speculative_tokens: int = 0,
        quantization: str | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``kv_dtype``: the paged KV cache's dtype (``--kv-cache-dtype``; default ``dtype``)."""
        self.config = config or ModelConfig.from_dir(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        # --speculative mtp: the checkpoint's MTP head drafts inside each step (model/mtp_drafter.py).
        self.model = load_model(model_dir, self.config, dtype, self.device, mtp=mtp_speculative_tokens > 0,
                                quantization=quantization)
        # The tokenizer may know fewer ids than the embedding has rows (padded vocabularies).
        self.sampler = Sampler(vocab_size or self.config.vocab_size)
        self.kv_caches: list[Cache] = []
        self.block_size = 0
        self.kv_group_windows = group_windows(self.config)
        self.mtp: MtpDrafter | None = None
        if mtp_speculative_tokens:
            self.mtp = MtpDrafter(self.model, mtp_speculative_tokens, self.sampler.vocab_size,  # type: ignore[arg-type]
                                  self._prepare)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one pool block: ``block_size`` tokens of K/V for the layers of one KV cache
        group (all attention layers when there is one group)."""
        per_token = type(self.model).kv_bytes_per_token(self.config, self.kv_dtype.itemsize)
        block = kv_block_bytes(self.config, per_token, block_size)
        if self.mtp is not None:  # the MTP layers' own KV lives in the same blocks
            block += self.mtp.kv_bytes_per_token(self.kv_dtype.itemsize) * block_size
        return block

    def state_bytes_per_sequence(self) -> int:
        return type(self.model).state_bytes_per_sequence(self.config, self.dtype.itemsize)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        """The paged KV pool (full-attention layers) and, for hybrid models, the state slots (those
        of running sequences, then the state checkpoints: the engine numbers them alike)."""
        self.kv_caches = self.model.make_caches(num_blocks, block_size, num_state_slots, self.dtype, self.device,
                                                self.kv_dtype)
        self.block_size = block_size
        if self.mtp is not None:
            self.mtp.allocate(num_blocks, block_size, self.kv_dtype, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        # Decode rows first so that their attention is one batched call.
        seqs = sorted(batch.seqs, key=lambda s: s.num_tokens != 1)
        input_ids, positions, meta, logits_rows, sampling_seqs = self._prepare(seqs)
        # Hybrid prefix hits: the checkpointed state first (all of them before any layer runs, so
        # a save of this step can never overwrite one before it was read).
        restores = [(s.restore_state_from, s.state_slot) for s in seqs if s.restore_state_from is not None]
        if restores:
            self._copy_states(restores)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # Checkpoints at the end of a chunk: the state the forward left in the slot. (Those inside a
        # prefill chunk were taken by the linear layers themselves: PrefillSpan.checkpoints.)
        ends = [(slot, s.state_slot) for s in seqs for offset, slot in s.state_checkpoints if offset == s.num_tokens]
        if ends:
            self._copy_states([(src, dst) for dst, src in ends])
        if any(s.prompt_logprob_targets for s in seqs):
            batch.prompt_logprobs = self._score_prompts(seqs, hidden)
        if not sampling_seqs:
            if self.mtp is not None:
                self.mtp.draft(seqs, hidden, {})  # prefill chunks: the head's KV keeps up
            return {}
        logits = self.model.compute_logits(hidden[logits_rows])
        rows = []
        for s in sampling_seqs:
            row = SamplingRow(s.sampling, s.prompt_token_ids, s.output_token_ids, s.generator, s.banned_token_ids)
            # A sequence with drafts is greedy and plain (the scheduler sees to it): one row per position.
            rows.extend([row] * (1 + len(s.draft_token_ids)))
        metadata = SamplingMetadata.build(rows, self.sampler.vocab_size, self.device)
        metadata.grammar_rows, metadata.grammar_bitmask = self._grammar_bitmask(sampling_seqs)
        sampled = self.sampler(logits, metadata)
        tokens = self._to_tokens(sampling_seqs, sampled)
        if meta.pending_states:
            self._keep_accepted_states(sampling_seqs, tokens, meta)
        if self.mtp is not None:
            self.mtp.draft(seqs, hidden, tokens)  # the next step's drafts, from the model's MTP head
        return tokens

    def _score_prompts(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """Prompt logprobs: each asking sequence's known next tokens scored from its chunk's rows
        (the flat batch holds the sequences in ``seqs`` order, as ``_prepare`` laid them out)."""
        scores = {}
        start = 0
        for s in seqs:
            targets = s.prompt_logprob_targets
            if targets:
                rows = hidden[start : start + len(targets)]
                ids = torch.tensor(list(targets), dtype=torch.long, device=self.device)
                scores[s.request_id] = score_tokens(self.model.compute_logits, rows, ids,
                                                    s.sampling.prompt_logprobs or 0, self.sampler.vocab_size)
            start += s.num_tokens
        return scores

    @staticmethod
    def _keep_accepted_states(
        seqs: list[ScheduledSeq], tokens: dict[str, SampledToken], meta: AttentionMetadata
    ) -> None:
        """Hybrid models with drafts: the linear layers left those sequences' slots untouched; now
        that acceptance is known, each slot gets the state after its last known token and the
        accepted drafts (the scheduler applies the same rule to the tokens: num_accepted_drafts)."""
        kept = {
            s.state_slot: 1 + num_accepted_drafts(s.draft_token_ids, tokens[s.request_id])
            for s in seqs if s.draft_token_ids
        }
        for pending in meta.pending_states:
            pending.commit(kept)

    def _prepare(
        self, seqs: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[ScheduledSeq]]:
        bs = self.block_size
        device = self.device
        token_ids: list[int] = []
        pos_list: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling_seqs: list[ScheduledSeq] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_slots: list[int] = []
        prefills: list[PrefillSpan] = []
        # Every token as a decode query (table, context length), for the model's one-call decode
        # layers when the step is small enough for them (see AttentionMetadata.token_block_tables).
        per_token = sum(s.num_tokens for s in seqs) <= self.model.fused_step_tokens()
        token_tables: list[list[int]] = []
        token_lens: list[int] = []
        for seq in seqs:
            start = len(token_ids)
            n = seq.num_tokens
            table = seq.block_table
            token_ids.extend(seq.token_ids)
            for pos in range(seq.start_pos, seq.start_pos + n):
                pos_list.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            context_len = seq.start_pos + n
            slot = -1 if seq.state_slot is None else seq.state_slot
            blocks = list(table[: -(-context_len // bs)])  # those the step's tokens attend over
            if n == 1:
                decode_tables.append(blocks)
                decode_lens.append(context_len)
                decode_slots.append(slot)
            else:
                # Not with a fresh prompt beside a narrower cache: the torch path attends to such a
                # prompt's own unrounded K/V, so its first token does not move with --kv-cache-dtype.
                per_token = per_token and (seq.start_pos > 0 or self.kv_dtype == self.dtype)
                if per_token:
                    token_tables.extend([blocks] * n)
                    token_lens.extend(range(seq.start_pos + 1, context_len + 1))
                block_table = torch.tensor(blocks, dtype=torch.long, device=device)
                inside = [(offset, ckpt) for offset, ckpt in seq.state_checkpoints if offset < n]
                prefills.append(PrefillSpan(start, n, context_len, block_table, slot, inside,
                                            drafts=bool(seq.draft_token_ids) and seq.state_slot is not None))
            if seq.sample:
                logits_rows.extend(range(start + n - 1 - len(seq.draft_token_ids), start + n))
                sampling_seqs.append(seq)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decode_tokens=len(decode_tables),
            prefills=prefills,
        )
        if decode_tables:
            meta.decode_block_tables = _padded_tables(decode_tables, device)
            width = meta.decode_block_tables.shape[1]
            lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
            cols = torch.arange(width * bs, device=device)
            meta.decode_mask = (cols[None, :] < lens[:, None])[:, None, None, :]
            meta.decode_context_lens = lens
            meta.max_decode_context_len = max(decode_lens)
            meta.decode_state_slots = torch.tensor(decode_slots, dtype=torch.long, device=device)
        if self.kv_group_windows != [None] and seqs:
            # Layers of different groups share KV tensors: one table for all would mix their KV.
            if len(seqs[0].group_block_tables) != len(self.kv_group_windows):
                raise RuntimeError("this model's sliding-window layers need a table per KV cache group: build its "
                                   "KVCacheManager with group_windows=runner.kv_group_windows")
            meta.groups = [self._group_meta(seqs, g, window, per_token) for g, window in enumerate(self.kv_group_windows)]
        if per_token:
            _set_token_tables(meta, decode_tables, decode_lens, token_tables, token_lens, device)
        return (
            torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(pos_list, dtype=torch.long, device=device),
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=device),
            sampling_seqs,
        )

    def _group_meta(self, seqs: list[ScheduledSeq], group: int, window: int | None, per_token: bool) -> AttentionMetadata:
        """One KV cache group's attention metadata: its tables (a freed sliding block, -1, reads as
        block 0, which the window's mask hides), its slots and its window; with ``per_token``, every
        token's table too (the one-call decode layers')."""
        bs, device = self.block_size, self.device
        slots: list[int] = []
        tables: list[list[int]] = []
        lens: list[int] = []
        token_tables: list[list[int]] = []
        token_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        start = 0
        for seq in seqs:
            n = seq.num_tokens
            context_len = seq.start_pos + n
            table = [max(b, 0) for b in seq.group_block_tables[group][: -(-context_len // bs)]]
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(seq.start_pos, context_len))
            if n == 1:
                tables.append(table)
                lens.append(context_len)
            else:
                block_table = torch.tensor(table, dtype=torch.long, device=device)
                prefills.append(PrefillSpan(start, n, context_len, block_table))
                if per_token:
                    token_tables.extend([table] * n)
                    token_lens.extend(range(seq.start_pos + 1, context_len + 1))
            start += n
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), len(tables), prefills=prefills,
                                 window=window)
        if tables:
            meta.decode_block_tables = _padded_tables(tables, device)
            context = torch.tensor(lens, dtype=torch.long, device=device)
            cols = torch.arange(meta.decode_block_tables.shape[1] * bs, device=device)
            visible = cols[None, :] < context[:, None]
            if window is not None:
                visible &= cols[None, :] >= context[:, None] - window
            meta.decode_mask = visible[:, None, None, :]
            meta.decode_context_lens = context
            meta.max_decode_context_len = max(lens)
        if per_token:
            _set_token_tables(meta, tables, lens, token_tables, token_lens, device)
        return meta

    def _copy_states(self, pairs: list[tuple[int | None, int | None]]) -> None:
        """Copy linear-layer state slot ``src`` to slot ``dst`` for each (src, dst), in every layer."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            if isinstance(cache, tuple):
                copy_state_slots(cache, src, dst)

    def _grammar_bitmask(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The constrained rows of the step's logits and their bitmasks, stacked (one copy to the device)."""
        indices: list[int] = []
        masks = []
        row = 0
        for s in seqs:
            num_rows = 1 + len(s.draft_token_ids)
            if s.grammar_bitmask is not None:
                indices.extend(range(row, row + num_rows))
                masks.append(torch.from_numpy(s.grammar_bitmask))
            row += num_rows
        if not masks:
            return None, None
        bitmask = torch.cat(masks) if len(masks) > 1 else masks[0]
        return (
            torch.tensor(indices, dtype=torch.long, device=self.device),
            bitmask.to(self.device, non_blocking=True),
        )

    @staticmethod
    def _to_tokens(seqs: list[ScheduledSeq], sampled: SamplerOutput) -> dict[str, SampledToken]:
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_logprob_ids.tolist() if sampled.top_logprob_ids is not None else None
        top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        out = {}
        row = 0
        for seq in seqs:
            token_logprobs = None
            wanted = seq.sampling.logprobs
            if wanted is not None and logprobs is not None:
                top = list(zip(top_ids[row][:wanted], top_values[row][:wanted])) if top_ids and wanted else []
                token_logprobs = TokenLogprobs(logprob=logprobs[row], top=top)
            end = row + 1 + len(seq.draft_token_ids)
            out[seq.request_id] = SampledToken(token_ids[row], token_logprobs, token_ids[row + 1 : end])
            row = end
        return out


def _set_token_tables(meta: AttentionMetadata, decode_tables: list[list[int]], decode_lens: list[int],
                      token_tables: list[list[int]], token_lens: list[int], device: torch.device) -> None:
    """Every token of the step as a decode query in ``meta`` (AttentionMetadata.token_block_tables):
    the decode rows first, as in the flat batch, then each span's tokens in order. A pure decode step
    shares the decode_* tensors."""
    if not token_tables:
        meta.token_block_tables, meta.token_context_lens = meta.decode_block_tables, meta.decode_context_lens
        meta.max_token_context_len = meta.max_decode_context_len
        return
    lens = decode_lens + token_lens
    meta.token_block_tables = _padded_tables(decode_tables + token_tables, device)
    meta.token_context_lens = torch.tensor(lens, dtype=torch.long, device=device)
    meta.max_token_context_len = max(lens)


def _padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables of unequal lengths as one [rows, longest] int64 tensor, padded with block 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)

"""Attention over a paged KV cache.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``. A
sequence's keys live in the blocks its block table lists; a token at position ``p`` sits in slot
``table[p // block_size] * block_size + p % block_size``. The per-step layout of the flat batch
travels in ``AttentionMetadata``, built by the runner: model code never sees requests.

A sliding-window layer (``window``) attends to the last ``window`` positions of each query, its own
included; every path here reads only those, so the blocks before a sequence's window may be freed
and its table entries there point anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from tokenline.model import cpu_kernels
from tokenline.model.prefill_attention import PrefillSpan, batches_prefills, prefill_batched


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    # The flat batch holds decode tokens (one per sequence) first, then prefill spans.
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64, padded with block 0
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool, True = attend
    decode_context_lens: torch.Tensor | None = None  # [D] int64: tokens each decode query attends to
    max_decode_context_len: int = 0
    decode_state_slots: torch.Tensor | None = None  # [D] int64: hybrid models' recurrent-state slots
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Every token of the step as a decode query (its sequence's table, the positions it attends to,
    # itself included): set by the runner for steps small enough for the model's one-call decode
    # layers (DecoderLM.fused_decode_rows), which then take prefill chunks and drafts too. A pure
    # decode step shares the decode_* tensors.
    token_block_tables: torch.Tensor | None = None  # [T, max_blocks] int64, padded with block 0
    token_context_lens: torch.Tensor | None = None  # [T] int64
    max_token_context_len: int = 0
    # The prefills as the C prefill attention reads them; built by the first layer that needs them.
    prefill_spans: cpu_kernels.PrefillSpans | None = None
    # Filled by the forward: one ``gated_deltanet.PendingStates`` per linear layer with ``drafts``
    # spans; the runner commits them once acceptance is known.
    pending_states: list[Any] = field(default_factory=list)
    # Sliding-window layers: a query at position p sees positions > p - window only (None: all).
    window: int | None = None
    # Models with several KV cache groups (model/kv_groups.py): each group's own metadata (its
    # block tables, slots and window); a layer attends with its group's. Empty: one group, this one.
    groups: list[AttentionMetadata] = field(default_factory=list)


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One layer's paged KV tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``.

    ``dtype`` is the model's, or bfloat16 under ``--kv-cache-dtype bfloat16``. The torch decode path
    reads padded rows of unused slots, where garbage could be NaN, so it needs zeros; the C kernel
    reads only written slots, so its pool stays untouched (not resident) until sequences fill it.
    """
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    reads_only_written = torch.device(device).type == "cpu" and cpu_kernels.load() is not None
    return (torch.empty if reads_only_written else torch.zeros)(shape, dtype=dtype, device=device)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q: [T, H, D]; k, v: [T, KVH, D].
    ``window``: each query sees only its last ``window`` positions (None or 0: all); ``scale``: the
    scores' factor (default 1/sqrt(head_dim))."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    # The layer's own window, or its KV cache group's (the runner's metadata for that group).
    window = window or meta.window or None
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    # A bfloat16 cache beside float32 activations (--kv-cache-dtype) stores rounded K/V; every read
    # below widens them back to the queries' dtype.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    kernels = cpu_kernels.load() if q.device.type == "cpu" else None
    if num_decode and kernels is not None and meta.decode_context_lens is not None:
        # Reads each sequence's blocks in place: no padded copy of the history per layer.
        query = q[:num_decode]
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        out[:num_decode] = kernels.decode_attention(
            query, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.max_decode_context_len, scale, window,
        )
    elif num_decode:
        keys = _gather_tables(k_cache, meta.decode_block_tables).to(q.dtype)
        values = _gather_tables(v_cache, meta.decode_block_tables).to(q.dtype)
        query = q[:num_decode].unsqueeze(2)  # [D, H, 1, Dh]
        mask = meta.decode_mask
        if window is not None and mask is not None and meta.decode_context_lens is not None:
            cols = torch.arange(mask.shape[-1], device=q.device)
            first = (meta.decode_context_lens - window).clamp(min=0)
            mask = mask & (cols[None, :] >= first[:, None])[:, None, None, :]
            # A freed block's slot may hold anything (even NaN), and a masked score still multiplies
            # its value: zero every row the window hides.
            hidden = ~mask[:, 0, 0, :, None].unsqueeze(1)  # [D, 1, cols, 1]
            keys, values = keys.masked_fill(hidden, 0), values.masked_fill(hidden, 0)
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[:num_decode] = attended.squeeze(2)

    if meta.prefills and kernels is not None and kernels.has_avx512bf16 and q.dtype == torch.bfloat16:
        if meta.prefill_spans is None:
            meta.prefill_spans = prefill_spans(meta.prefills)
        if kernels.prefill_attention_bf16_(q, k_cache, v_cache, meta.prefill_spans, scale, out, window):
            return out
    if len(meta.prefills) > 1 and batches_prefills(meta.prefills, q, window):
        prefill_batched(q, k, v, k_cache, v_cache, meta.prefills, out, scale)
        return out
    for span in meta.prefills:
        end = span.start + span.num_tokens
        query = q[span.start : end].transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
        offset = span.context_len - span.num_tokens  # the chunk's first position
        # The first key any query of the chunk sees: older blocks are not read at all.
        first = max(0, offset - window + 1) if window is not None else 0
        if span.context_len == span.num_tokens and (window is None or span.num_tokens <= window):
            # Nothing cached before this chunk and no key leaves a window: its own fresh K/V, plainly causal.
            keys = k[span.start : end].transpose(0, 1).unsqueeze(0)
            values = v[span.start : end].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            if span.context_len == span.num_tokens:
                keys, values = k[span.start : end].transpose(0, 1), v[span.start : end].transpose(0, 1)
            else:
                keys = _gather(k_cache, span, first).to(q.dtype)
                values = _gather(v_cache, span, first).to(q.dtype)
            # Token i of the chunk sits at position (offset + i) and sees keys up to it (and, in a
            # window, after offset + i - window).
            rows = torch.arange(span.num_tokens, device=q.device)[:, None] + offset
            cols = torch.arange(first, span.context_len, device=q.device)[None, :]
            mask = cols <= rows
            if window is not None:
                mask &= cols > rows - window
            attended = F.scaled_dot_product_attention(
                query, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[span.start : end] = attended[0].transpose(0, 1)
    return out


def prefill_spans(spans: list[PrefillSpan]) -> cpu_kernels.PrefillSpans:
    """The spans' rows, lengths and block tables (padded with block 0) as int64 tensors."""
    tables = pad_sequence([s.block_table for s in spans], batch_first=True).to(torch.int64)
    columns = torch.tensor([[s.start, s.num_tokens, s.context_len] for s in spans], dtype=torch.int64).T.contiguous()
    return cpu_kernels.PrefillSpans(columns[0], columns[1], columns[2], tables)


def _gather_tables(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Blocks of several sequences as [D, KVH, blocks * block_size, Dh].

    ``index_select`` on the flattened table is a plain row gather; advanced indexing with a 2-D
    index goes through a much slower generic kernel on CPU.
    """
    num_seqs, width = tables.shape
    rows = cache.index_select(0, tables.reshape(-1))  # [D * blocks, block_size, KVH, Dh]
    return rows.view(num_seqs, width * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _gather(cache: torch.Tensor, span: PrefillSpan, first: int = 0) -> torch.Tensor:
    """Cached rows ``first .. context_len`` of a sequence as [KVH, context_len - first, Dh], reading
    only the blocks that hold them."""
    block_size = cache.shape[1]
    skip = first // block_size
    rows = cache.index_select(0, span.block_table[skip : (span.context_len + block_size - 1) // block_size])
    return rows.flatten(0, 1)[first - skip * block_size : span.context_len - skip * block_size].transpose(0, 1)

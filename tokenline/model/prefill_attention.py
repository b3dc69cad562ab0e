"""Several prefill spans' attention in one call.

``paged_attention`` attends each span on its own: one SDPA, one mask and one gather of its cached
keys per span. When a step holds many short spans (several new requests, chunks side by side,
speculative drafts being verified) that per-call work outweighs the arithmetic, so they run here
as one padded batch: queries padded to the longest span, keys and values to the longest context,
and a causal mask per span that is offset by its cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence


@dataclass
class PrefillSpan:
    """A run of tokens from one sequence that attends causally to its own cached context."""

    start: int  # index of its first token in the flat batch
    num_tokens: int
    context_len: int  # tokens the chunk attends to, itself included (cached + new)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    state_slot: int = -1  # hybrid models: the sequence's recurrent-state slot (-1: none)
    # Hybrid models: (tokens into the span, slot) — copy the state there after that many tokens.
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    # Hybrid models, speculative decoding: the span ends with draft tokens, so its linear layers
    # leave the slot as it was and report what commits the state after the accepted ones
    # (``AttentionMetadata.pending_states``). Attention needs nothing: rejected KV is overwritten later.
    drafts: bool = False


# Batch a step's spans only when there are at least this many, each one's query rows padded to the
# longest span take at most this many bytes, and padding widens the keys at most twofold. On CPU
# each span's own SDPA call, mask and gathers cost tens of microseconds, which batching saves; the
# padded copies of the queries in and the outputs out cost in proportion to those bytes (and with
# few spans there is little to save). Measured with bench/attention_batched_prefill.py.
BATCHED_PREFILL_MIN_SPANS = 8
BATCHED_PREFILL_MAX_QUERY_BYTES = 12 * 1024


def batches_prefills(spans: list[PrefillSpan], q: torch.Tensor, window: int | None = None) -> bool:
    """Whether ``prefill_batched`` beats one call per span for these spans (q: [T, H, D]). Not where a
    span's context passes a sliding ``window``: its blocks before the window may be freed, and the
    batch reads every block of each table."""
    if len(spans) < BATCHED_PREFILL_MIN_SPANS:
        return False
    if window and max(s.context_len for s in spans) > window:
        return False
    longest = max(s.num_tokens for s in spans)
    if longest * q.shape[1] * q.shape[2] * q.element_size() > BATCHED_PREFILL_MAX_QUERY_BYTES:
        return False
    return len(spans) * max(s.context_len for s in spans) <= 2 * sum(s.context_len for s in spans)


def prefill_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[PrefillSpan],
    out: torch.Tensor,
    scale: float | None = None,
) -> None:
    """Attend every span in one SDPA and write the rows of ``out`` they own.

    q: [T, H, D]; k, v: [T, KVH, D] (this step's, already in the cache);
    k_cache, v_cache: [num_blocks, block_size, KVH, D].
    """
    device = q.device
    longest = max(s.num_tokens for s in spans)
    # Padding is zeros: finite, and masked or past every real query, so its outputs are dropped.
    query = pad_sequence([q[s.start : s.start + s.num_tokens] for s in spans], batch_first=True).transpose(1, 2)
    if all(s.context_len == s.num_tokens for s in spans):
        # Nothing cached before any span: its own fresh K/V, and query i sees keys 0..i, plainly
        # causal (a span's padding keys come after all its real queries).
        keys = pad_sequence([k[s.start : s.start + s.num_tokens] for s in spans], batch_first=True)
        values = pad_sequence([v[s.start : s.start + s.num_tokens] for s in spans], batch_first=True)
        attended = F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        blocks, unwritten = _context_layout(spans, k_cache.shape[1], device)
        keys = _padded_context(k_cache, blocks, unwritten, len(spans)).to(q.dtype)  # a bfloat16 cache widened
        values = _padded_context(v_cache, blocks, unwritten, len(spans)).to(q.dtype)
        # Token i of a span sits at position (context_len - num_tokens + i) and sees keys up to it.
        offsets = torch.tensor([s.context_len - s.num_tokens for s in spans], device=device)
        seen = torch.arange(longest, device=device)[None, :] + offsets[:, None]  # [B, Lq]
        mask = torch.arange(keys.shape[2], device=device)[None, None, :] <= seen[:, :, None]
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)

    per_span = attended.transpose(1, 2)  # [B, Lq, H, D]
    first, last = spans[0], spans[-1]
    if all(a.start + a.num_tokens == b.start for a, b in pairwise(spans)):
        # Side by side in the flat batch (the runner's layout): one copy of the real rows.
        torch.cat([per_span[i, : s.num_tokens] for i, s in enumerate(spans)],
                  out=out[first.start : last.start + last.num_tokens])
    else:
        for i, s in enumerate(spans):
            out[s.start : s.start + s.num_tokens] = per_span[i, : s.num_tokens]


def _context_layout(spans: list[PrefillSpan], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks to gather for a padded batch of the spans' contexts (each table padded to the
    longest) and the flat rows of that batch past each span's context, to be zeroed: those were
    never written (the pool may be torch.empty) and would leak through the mask as 0 x NaN."""
    width = max(len(s.block_table) for s in spans) * block_size
    blocks = pad_sequence([s.block_table for s in spans], batch_first=True).flatten()
    unwritten = [width - s.context_len for s in spans]
    total = sum(unwritten)
    # Row j >= context_len of span b is flat row b * width + j.
    firsts = torch.tensor([b * width + s.context_len for b, s in enumerate(spans)], device=device)
    counts = torch.tensor(unwritten, device=device)
    skips = torch.repeat_interleave(firsts - (torch.cumsum(counts, 0) - counts), counts, output_size=total)
    return blocks, torch.arange(total, device=device) + skips


def _padded_context(cache: torch.Tensor, blocks: torch.Tensor, unwritten: torch.Tensor, num_spans: int) -> torch.Tensor:
    """The spans' cached rows as [B, KVH, width, Dh]: one gather of whole blocks, unwritten rows zeroed."""
    rows = cache.index_select(0, blocks)
    rows.view(-1, rows.shape[-2] * rows.shape[-1]).index_fill_(0, unwritten, 0)
    return rows.view(num_spans, -1, *cache.shape[2:]).transpose(1, 2)

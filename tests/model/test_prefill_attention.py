"""Several prefill spans through attention in one padded call equal one call per span."""

from __future__ import annotations

import pytest
import torch

from tokenline.model import prefill_attention
from tokenline.model.attention import AttentionMetadata, paged_attention
from tokenline.model.prefill_attention import PrefillSpan, batches_prefills

BLOCK_SIZE = 4


def make_step(
    lens: list[int], prefixes: list[int], heads: int, kv_heads: int, dtype: torch.dtype, gap: int = 0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step of prefill spans whose prefixes are already cached, in a pool that holds NaN wherever
    nothing was written, blocks handed out in a shuffled order; ``gap`` rows of other work (with
    slots of their own) after each span."""
    head_dim = 16
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-(p + n) // BLOCK_SIZE) for n, p in zip(lens, prefixes)]
    scratch = -(-gap * len(lens) // BLOCK_SIZE)
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    cache = torch.full((2, sum(blocks) + scratch, BLOCK_SIZE, kv_heads, head_dim), float("nan"), dtype=dtype)
    rows = sum(lens) + gap * len(lens)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
    slots: list[int] = []
    gap_slots = iter(range(sum(blocks) * BLOCK_SIZE, (sum(blocks) + scratch) * BLOCK_SIZE))
    for n, p, b in zip(lens, prefixes, blocks):
        table = [order.pop() for _ in range(b)]
        for pos in range(p):  # the cached prefix, written by earlier steps
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            cache[:, block, offset] = torch.randn(2, kv_heads, head_dim, generator=gen).to(dtype)
        meta.prefills.append(PrefillSpan(len(slots), n, p + n, torch.tensor(table)))
        slots.extend(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(p, p + n))
        slots.extend(next(gap_slots) for _ in range(gap))
    meta.slot_mapping = torch.tensor(slots)
    return q, k, v, cache, meta


def attend(q, k, v, cache, meta, batched: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(prefill_attention, "BATCHED_PREFILL_MIN_SPANS", 2 if batched else 10**9)
    monkeypatch.setattr(prefill_attention, "BATCHED_PREFILL_MAX_QUERY_BYTES", 10**12)
    with torch.inference_mode():
        return paged_attention(q, k, v, cache.clone(), meta)


def span_rows(meta: AttentionMetadata) -> list[int]:
    return [r for s in meta.prefills for r in range(s.start, s.start + s.num_tokens)]


CASES = {
    "fresh, different lengths": ([5, 2, 9, 3], [0, 0, 0, 0]),
    "cached prefixes, different lengths": ([3, 7, 2, 4, 6], [5, 12, 1, 8, 0]),
    "prefix ends inside a block": ([2, 2, 2], [3, 6, 9]),
    "one token each after a long prefix": ([2, 2, 2, 2, 2, 2, 2, 2], [40, 3, 17, 25, 8, 31, 2, 11]),
}


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", list(CASES))
def test_batched_equals_one_by_one_float32(case: str, heads: int, kv_heads: int, monkeypatch) -> None:
    lens, prefixes = CASES[case]
    q, k, v, cache, meta = make_step(lens, prefixes, heads, kv_heads, torch.float32)
    one = attend(q, k, v, cache, meta, False, monkeypatch)
    together = attend(q, k, v, cache, meta, True, monkeypatch)
    rows = span_rows(meta)
    assert torch.isfinite(together[rows]).all()  # the NaN in unwritten slots never leaks in
    torch.testing.assert_close(together[rows], one[rows], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_batched_equals_one_by_one_bfloat16(case: str, monkeypatch) -> None:
    lens, prefixes = CASES[case]
    q, k, v, cache, meta = make_step(lens, prefixes, 6, 2, torch.bfloat16, seed=1)
    one = attend(q, k, v, cache, meta, False, monkeypatch)
    together = attend(q, k, v, cache, meta, True, monkeypatch)
    rows = span_rows(meta)
    # Within bf16 rounding of the output (its spacing is 2^-8 relative).
    torch.testing.assert_close(together[rows].float(), one[rows].float(), atol=2e-2, rtol=1e-2)


def test_spans_apart_in_the_batch_keep_their_rows(monkeypatch) -> None:
    # Spans need not sit side by side: rows between them are not theirs and stay untouched.
    q, k, v, cache, meta = make_step([3, 5, 2], [4, 0, 9], 6, 2, torch.float32, gap=2)
    one = attend(q, k, v, cache, meta, False, monkeypatch)
    together = attend(q, k, v, cache, meta, True, monkeypatch)
    rows = span_rows(meta)
    torch.testing.assert_close(together[rows], one[rows], atol=1e-6, rtol=1e-5)


def test_threshold_batches_many_small_spans_only() -> None:
    q = torch.empty(0, 9, 64)  # the default model's heads, float32: 2,304 query bytes a token
    table = torch.zeros(1, dtype=torch.long)
    few = [PrefillSpan(2 * i, 2, 2, table) for i in range(prefill_attention.BATCHED_PREFILL_MIN_SPANS - 1)]
    many = few + [PrefillSpan(2 * len(few), 2, 2, table)]
    longer = [PrefillSpan(8 * i, 8, 8, table) for i in range(len(many))]
    one_wider = many[:-1] + [PrefillSpan(2 * len(few), 2, 4000, torch.zeros(1000, dtype=torch.long))]
    assert not batches_prefills(few, q)
    assert batches_prefills(many, q)
    assert not batches_prefills(longer, q)  # 8 query rows a span: 18 KiB
    assert batches_prefills(longer, q.to(torch.bfloat16))  # half the bytes
    assert not batches_prefills(one_wider, q)  # every span's keys padded to 4,000
    assert not batches_prefills(many[:-1] + [PrefillSpan(2 * len(few), 5, 5, table)], q)  # queries padded 2.5x

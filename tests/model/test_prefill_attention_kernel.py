"""The C prefill-attention kernel (bfloat16, AVX512-BF16) against a float64 reference, and the fused
SiLU-times-up kernel against torch's two operators, bit for bit.

Prefill spans: fresh prompts and chunks after a cached prefix, lengths that cut the 16-query items
and the 16-key tiles anywhere, a one-token span, GQA groups of 1, 3 and 4, head sizes 32 and 64,
blocks of 4 and 16 tokens handed out shuffled, and a pool holding NaN wherever nothing was written.
Where the build has no AVX512-BF16 the kernel must decline (return False, write nothing), so the
SDPA path runs; the builds without it and without AVX-512 are checked on this same CPU. The fused
tanh-GELU-times-up kernel (Gemma 3's bfloat16 decode layer) against an exact reference and torch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenline.model import cpu_kernels
from tokenline.model.attention import AttentionMetadata, paged_attention, prefill_spans
from tokenline.model.prefill_attention import PrefillSpan

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


def _case(lens: list[int], prefixes: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0):
    """q as a strided view of wider rows (as the model's q|k|v split is), a NaN pool with each span's
    prefix and its own new K/V written at shuffled blocks, and the spans."""
    gen = torch.Generator().manual_seed(seed)
    ctxs = [p + n for n, p in zip(lens, prefixes)]
    nblocks = [-(-c // block_size) for c in ctxs]
    order = torch.randperm(sum(nblocks) + 3, generator=gen).tolist()
    k_cache = torch.full((sum(nblocks) + 3, block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    rows = sum(lens)
    wide = torch.randn(rows, heads * head_dim + 5, generator=gen).bfloat16()
    q = wide[:, : heads * head_dim].view(rows, heads, head_dim)
    spans, start = [], 0
    for n, c, b in zip(lens, ctxs, nblocks):
        table = torch.tensor([order.pop() for _ in range(b)])
        for pos in range(c):
            k_cache[table[pos // block_size], pos % block_size] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[table[pos // block_size], pos % block_size] = torch.randn(kv_heads, head_dim, generator=gen)
        spans.append(PrefillSpan(start, n, c, table))
        start += n
    return q, k_cache, v_cache, spans


def _reference(q, k_cache, v_cache, spans, window: int | None = None) -> torch.Tensor:
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in spans:
        keys = k_cache[s.block_table].flatten(0, 1)[: s.context_len].double().transpose(0, 1)
        values = v_cache[s.block_table].flatten(0, 1)[: s.context_len].double().transpose(0, 1)
        query = q[s.start : s.start + s.num_tokens].double().transpose(0, 1)
        seen = torch.arange(s.num_tokens)[:, None] + (s.context_len - s.num_tokens)
        mask = torch.arange(s.context_len)[None, :] <= seen
        if window is not None:
            mask &= torch.arange(s.context_len)[None, :] > seen - window
        attended = F.scaled_dot_product_attention(
            query, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0), attn_mask=mask,
            scale=1 / math.sqrt(head_dim),
        )
        out[s.start : s.start + s.num_tokens] = attended.transpose(0, 1)
    return out


CASES = [  # lens, cached prefixes, heads, kv heads, head_dim, block size
    ([256, 256], [0, 0], 9, 3, 64, 16),  # the default model's fresh prompts
    ([5, 17, 33, 1], [0, 40, 100, 7], 9, 3, 64, 16),  # chunks after cached prefixes, a one-token span
    ([31, 16, 15], [0, 0, 0], 4, 1, 32, 4),  # tiles cut by 4-token blocks, one KV head for all
    ([50], [77], 8, 8, 64, 16),  # no grouping
]


@pytest.mark.skipif(kernels is None or not kernels.has_avx512bf16, reason="no AVX512-BF16: SDPA runs instead")
@pytest.mark.parametrize("lens,prefixes,heads,kv_heads,head_dim,block_size", CASES)
def test_spans_match_reference(lens, prefixes, heads, kv_heads, head_dim, block_size) -> None:
    q, k_cache, v_cache, spans = _case(lens, prefixes, heads, kv_heads, head_dim, block_size)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    assert kernels.prefill_attention_bf16_(q, k_cache, v_cache, prefill_spans(spans), 1 / math.sqrt(head_dim), out)
    ref = _reference(q, k_cache, v_cache, spans)
    assert torch.isfinite(out).all()
    # Outputs are weighted means of N(0, 1) values: a bfloat16 step there is <= 2^-7; a missed mask,
    # a wrong head or a dropped tile moves them by tenths.
    assert (out.double() - ref).abs().max().item() < 0.02


@pytest.mark.skipif(kernels is None or not kernels.has_avx512bf16, reason="no AVX512-BF16: SDPA runs instead")
def test_paged_attention_takes_the_kernel_for_bfloat16_prefills() -> None:
    """Through paged_attention (K/V written to the cache first): the same rows as the reference, and
    as close to it as torch's own bfloat16 SDPA gets."""
    q, k_cache, v_cache, spans = _case([40, 24], [0, 0], 9, 3, 64, 16, seed=1)
    k = torch.stack([k_cache[s.block_table].flatten(0, 1)[i] for s in spans for i in range(s.num_tokens)])
    v = torch.stack([v_cache[s.block_table].flatten(0, 1)[i] for s in spans for i in range(s.num_tokens)])
    slots = torch.tensor([int(s.block_table[i // 16]) * 16 + i % 16 for s in spans for i in range(s.num_tokens)])
    meta = AttentionMetadata(slot_mapping=slots, prefills=spans)
    out = paged_attention(q, k, v, torch.stack([k_cache, v_cache]), meta)
    assert meta.prefill_spans is not None  # built once, for every layer of the step
    ref = _reference(q, k_cache, v_cache, spans)
    sdpa_err = max(
        (F.scaled_dot_product_attention(
            q[s.start : s.start + s.num_tokens].transpose(0, 1).unsqueeze(0),
            k[s.start : s.start + s.num_tokens].transpose(0, 1).unsqueeze(0),
            v[s.start : s.start + s.num_tokens].transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True,
        )[0].transpose(0, 1).double() - ref[s.start : s.start + s.num_tokens]).abs().max().item()
        for s in spans
    )
    assert (out.double() - ref).abs().max().item() <= 2 * sdpa_err + 1e-3


def _forget_before_window(k_cache, v_cache, spans, window: int) -> list[PrefillSpan]:
    """Blocks wholly before the window of a span's first query are NaN and its table points at an
    unused NaN block there, as a KV manager that frees sliding-window blocks leaves them."""
    block_size = k_cache.shape[1]
    live = {b for s in spans for b in s.block_table.tolist()}
    spare = next(b for b in range(k_cache.shape[0]) if b not in live)
    forgotten = []
    for s in spans:
        gone = max(0, s.context_len - s.num_tokens - window + 1) // block_size
        k_cache[s.block_table[:gone]] = float("nan")
        v_cache[s.block_table[:gone]] = float("nan")
        table = s.block_table.clone()
        table[:gone] = spare
        forgotten.append(PrefillSpan(s.start, s.num_tokens, s.context_len, table))
    return forgotten


WINDOW_CASES = [  # lens, cached prefixes: fresh spans longer than the window, chunks past it, one token
    ([60, 20, 1, 24], [0, 100, 57, 24]),
    ([23, 25], [3, 200]),
]


@pytest.mark.parametrize("lens,prefixes", WINDOW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_reads_only_the_window(lens, prefixes, dtype) -> None:
    """window=24 over 4-token blocks: each query attends to its last 24 positions (itself included),
    through paged_attention (the C kernel for bfloat16 with AVX512-BF16, SDPA over only the window's
    blocks otherwise), never reading the blocks before the window."""
    window = 24
    q, k_cache, v_cache, spans = _case(lens, prefixes, 4, 1, 64, 4, seed=3)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    ref = _reference(q, k_cache, v_cache, spans, window)
    k = torch.stack([k_cache[s.block_table].flatten(0, 1)[s.context_len - s.num_tokens + i]
                     for s in spans for i in range(s.num_tokens)])
    v = torch.stack([v_cache[s.block_table].flatten(0, 1)[s.context_len - s.num_tokens + i]
                     for s in spans for i in range(s.num_tokens)])
    slots = torch.tensor([int(s.block_table[p // 4]) * 4 + p % 4 for s in spans
                          for p in range(s.context_len - s.num_tokens, s.context_len)])
    spans = _forget_before_window(k_cache, v_cache, spans, window)
    meta = AttentionMetadata(slot_mapping=slots, prefills=spans)
    out = paged_attention(q, k, v, torch.stack([k_cache, v_cache]), meta, window=window)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < (0.02 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("flags", [("-mno-avx512bf16",), ("-mno-avx512f",)])
def test_builds_without_the_instructions_decline_and_keep_silu_exact(flags, portable_build) -> None:
    portable = portable_build(flags)
    q, k_cache, v_cache, spans = _case([20], [0], 9, 3, 64, 16)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    assert not portable.prefill_attention_bf16_(q, k_cache, v_cache, prefill_spans(spans), 0.125, out)
    assert not out.any()  # nothing written: the caller's SDPA fills it
    _check_silu_mul(portable)
    _check_gelu_mul(portable)


def _check_silu_mul(k: cpu_kernels.CpuKernels) -> None:
    gen = torch.Generator().manual_seed(3)
    for rows, width in ((1, 1536), (9, 1536), (3, 21)):  # 21: a tail past the 16-lane vectors
        gate_up = (torch.randn(rows, 2 * width, generator=gen) * 6).bfloat16()
        # zero of both signs, and large gates of both signs (below about -87 the two differ: torch's
        # exp(-x) overflows to inf there and gives -0, ours gives the tiny true value)
        gate_up[0, :4] = torch.tensor([0.0, -0.0, 80.0, -80.0])
        gate, up = gate_up.split(width, dim=-1)
        assert torch.equal(k.silu_mul_bf16(gate_up), F.silu(gate) * up)


def test_silu_mul_is_torchs_two_operators_bit_for_bit() -> None:
    _check_silu_mul(kernels)
    with pytest.raises(ValueError):
        kernels.silu_mul_bf16(torch.zeros(2, 8))  # float32 rows are not its business


def _check_gelu_mul(k: cpu_kernels.CpuKernels) -> None:
    gen = torch.Generator().manual_seed(4)
    for rows, width in ((2, 2048), (3, 21)):  # 21: a tail past the 16-lane vectors
        # gates of both signs from 1e-6 to 1e6 in magnitude (the tails: gelu -> x and -> -0), plus the
        # extremes where x^3 overflows float32
        magnitude = 10.0 ** (torch.rand(rows, width, generator=gen) * 12 - 6)
        gate = (magnitude * torch.sign(torch.randn(rows, width, generator=gen))).bfloat16()
        gate[0, :6] = torch.tensor([0.0, -0.0, 3e38, -3e38, -4.0, -9.0])
        up = torch.randn(rows, width, generator=gen).bfloat16()
        up[0] = 1.0  # row 0: the GELU itself, rounded once
        out = k.gelu_mul_bf16(torch.cat([gate, up], dim=-1)).double()
        x = gate.double()
        # 0.5 x (1 + tanh(v)) as x sigmoid(2v): float64's 1 + tanh(v) cancels to 0 below v ~ -19
        exact = x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3))
        assert torch.isfinite(out).all()
        # within bfloat16's rounding of the GELU and of the product (2^-9 relative each)
        assert ((out - exact * up.double()).abs() <= 2.0**-7 * (exact * up.double()).abs() + 1e-30).all()
        # and torch's two operators, up to one bfloat16 step where float32's 1 + tanh(v) loses the tiny values
        ref = (F.gelu(gate, approximate="tanh") * up).double()
        assert ((out - ref).abs() <= 2.0**-7 * ref.abs() + 1e-6).all()


def test_gelu_mul_matches_torchs_tanh_gelu_across_the_range() -> None:
    _check_gelu_mul(kernels)
    with pytest.raises(ValueError):
        kernels.gelu_mul_bf16(torch.zeros(2, 8))

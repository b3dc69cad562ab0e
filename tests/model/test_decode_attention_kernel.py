"""The C decode-attention kernel against a float64 reference, on the shapes that stress its paths:
ragged contexts, GQA groups, block tables with holes and garbage in unused slots, context 1, tiles
cut by block boundaries, split-K runs (few sequences) merged, and the builds without AVX512-BF16
and without AVX-512 (the 8-lane vector path an AVX2 CPU runs) on this same CPU."""

from __future__ import annotations

import math

import pytest
import torch

from tokenline.model import cpu_kernels

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


def _reference(q, k_cache, v_cache, tables, lens) -> torch.Tensor:
    """Per sequence: gather its first len rows, attend in float64; query head h reads KV head h // group."""
    num_seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty(num_seqs, heads, head_dim, dtype=torch.float64)
    for d in range(num_seqs):
        n = int(lens[d])
        keys = k_cache[tables[d]].reshape(-1, kv_heads, head_dim)[:n].double()
        values = v_cache[tables[d]].reshape(-1, kv_heads, head_dim)[:n].double()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [n, H, Dh]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[d].double(), keys) / math.sqrt(head_dim)
        out[d] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def _case(seed, num_seqs, heads, kv_heads, head_dim, block_size, lens, dtype, spare_blocks=7):
    """A pool with the sequences' blocks scattered, unused blocks and unwritten tail slots full of NaN
    (the kernel must read only written slots), and tables padded with a hole-filler block id."""
    generator = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int64)
    widths = [(int(n) + block_size - 1) // block_size for n in lens]
    width = max(widths)
    num_blocks = sum(widths) + spare_blocks
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)
    used = 0
    for d, (n, w) in enumerate(zip(lens.tolist(), widths)):
        ids = order[used : used + w]
        used += w
        tables[d, :w] = ids
        tables[d, w:] = order[-1]  # padding points at an unused (NaN) block, as holes do
        rows = torch.randn(2, w * block_size, kv_heads, head_dim, generator=generator).to(dtype)
        for b, block in enumerate(ids.tolist()):
            count = min(block_size, n - b * block_size)  # the last block's tail stays NaN
            k_cache[block, :count] = rows[0, b * block_size : b * block_size + count]
            v_cache[block, :count] = rows[1, b * block_size : b * block_size + count]
    q = torch.randn(num_seqs, heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, lens


def _check(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, rtol32: float = 1e-5) -> None:
    assert torch.isfinite(ours).all()
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), reference, rtol=rtol32, atol=1e-6)
    else:
        # bf16 output (8-bit mantissa: a rounding step is up to 2^-8 relative) from weights also
        # rounded to bf16 before they meet the values: within two rounding steps of the exact result.
        torch.testing.assert_close(ours.double(), reference, rtol=2**-7, atol=2**-8)


SHAPES = [
    # heads, kv_heads, head_dim, block_size: the default model; GQA 4 and 1; MHA; head_dim 128 and 256, odd
    # multiples of 16 (48, 80: no pair-interleaved values), 24 (the 8-lane vector path on any CPU), 20
    # (not a multiple of 8: the scalar path); blocks larger than the 16-token tile and smaller.
    (9, 3, 64, 16),
    (8, 2, 64, 32),
    (12, 1, 64, 8),
    (4, 4, 128, 16),
    (4, 1, 256, 16),  # Gemma 3 270M: GQA 4 at head_dim 256 (its own copy; values in chunks)
    (6, 3, 48, 16),
    (4, 2, 80, 4),
    (4, 2, 24, 8),
    (4, 2, 20, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_ragged_batch_matches_reference(dtype, heads, kv_heads, head_dim, block_size) -> None:
    lens = [1, 17, 5 * block_size, 3 * block_size + 1, 40, 2, 16 * 5 + 9, 33]  # context 1, partial tiles
    q, k_cache, v_cache, tables, lens = _case(heads * head_dim, len(lens), heads, kv_heads, head_dim, block_size,
                                              lens, dtype)
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(head_dim))
    _check(ours, _reference(q, k_cache, v_cache, tables, lens), dtype)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_bfloat16_cache_beside_float32_queries(heads, kv_heads, head_dim, block_size) -> None:
    """--kv-cache-dtype bfloat16 on a float32 model (and a bfloat16 model's quantized layers): the rows
    are widened on read (the AVX-512 path here, the 8-lane one in the portable builds), the rest is
    float32 arithmetic: the float32 result on the rounded cache."""
    lens = [1, 17, 5 * block_size, 3 * block_size + 1, 40, 2, 16 * 5 + 9, 33]
    q, k_cache, v_cache, tables, lens = _case(heads + head_dim, len(lens), heads, kv_heads, head_dim, block_size,
                                              lens, torch.float32)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(head_dim))
    assert ours.dtype == torch.float32
    _check(ours, _reference(q, k_cache, v_cache, tables, lens), torch.float32)
    # One sequence of 89 tokens: a work item per KV head, cut into runs of blocks that merge after.
    one = (tables[6:7], lens[6:7])
    ours = kernels.decode_attention(q[6:7], k_cache, v_cache, *one, int(lens[6]), 1 / math.sqrt(head_dim))
    _check(ours, _reference(q[6:7], k_cache, v_cache, *one), torch.float32)
    with pytest.raises(ValueError, match="supports float32 and bfloat16"):
        kernels.decode_attention(q.bfloat16(), k_cache.float(), v_cache.float(), tables, lens, 1, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [700], [3, 1000], [129, 64]])
def test_few_sequences_split_into_runs_match_reference(dtype, lens) -> None:
    """Fewer sequences than threads x 2: each is cut into runs of blocks that merge afterwards,
    including runs past a short sequence's end (empty) beside a long one."""
    q, k_cache, v_cache, tables, lens = _case(len(lens), len(lens), 9, 3, 64, 16, lens, dtype)
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(64))
    _check(ours, _reference(q, k_cache, v_cache, tables, lens), dtype)


def test_large_scores_rescale_without_overflow() -> None:
    """Scores rising along the context (the running max moves up tile after tile) and one huge
    score: the online softmax must rescale, not overflow."""
    q, k_cache, v_cache, tables, lens = _case(5, 2, 9, 3, 64, 16, [300, 77], torch.float32)
    for d in range(2):
        for t in range(int(lens[d])):
            k_cache[tables[d, t // 16], t % 16] *= 1 + t / 20
    k_cache[tables[0, 3], 5] = q[0, :3] * 50  # token 53 of sequence 0: scores of several hundred
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(64))
    # A float32 score of several hundred carries ~3e-5 absolute rounding (its ulp), which exp turns
    # into that much relative error in the weights: the summation order (16 or 8 lanes) shows there.
    _check(ours, _reference(q, k_cache, v_cache, tables, lens), torch.float32, rtol32=1e-4)


@pytest.mark.parametrize("flags", [("-mno-avx512bf16",), ("-mno-avx512f",)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_builds_match_reference(flags, dtype, portable_build) -> None:
    """The same source built without the dot-product instructions, and without AVX-512 at all."""
    portable = portable_build(flags)
    assert not portable.has_avx512bf16
    q, k_cache, v_cache, tables, lens = _case(11, 5, 9, 3, 64, 16, [1, 50, 320, 16, 100], dtype)
    ours = portable.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(64))
    _check(ours, _reference(q, k_cache, v_cache, tables, lens), dtype)
    if dtype == torch.float32:  # and a bfloat16 cache beside the float32 queries (--kv-cache-dtype)
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
        ours = portable.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(64))
        _check(ours, _reference(q, k_cache, v_cache, tables, lens), dtype)


def _forget_before_window(k_cache, v_cache, tables, lens, window, block_size):
    """What a KV manager that frees sliding-window blocks leaves: every block wholly before a
    sequence's window is NaN and its table entries point anywhere (here at an unused, NaN block)."""
    tables = tables.clone()
    live = {b for d, n in enumerate(lens.tolist()) for b in tables[d, : (n + block_size - 1) // block_size].tolist()}
    spare = next(b for b in range(k_cache.shape[0]) if b not in live)
    for d, n in enumerate(lens.tolist()):
        gone = max(0, n - window) // block_size
        for block in tables[d, :gone].tolist():
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")
        tables[d, :gone] = spare
    return tables


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 1, 256), (9, 3, 64), (4, 2, 20)])
@pytest.mark.parametrize("lens", [[1, 17, 40, 100, 600, 1500, 513, 512], [1500]])
def test_sliding_window_reads_only_the_window(flags, dtype, heads, kv_heads, head_dim, lens, portable_build) -> None:
    """window=512 (Gemma 3's sliding layers): each query attends to its last 512 positions, its own
    included, equal to the reference on those rows alone; blocks before the window are never read
    (they hold NaN here), on the AVX-512, 8-lane and scalar paths, whole sequences and split runs."""
    lib = portable_build(flags) if flags else kernels
    window, block_size = 512, 16
    q, k_cache, v_cache, tables, lens = _case(len(lens) + head_dim, len(lens), heads, kv_heads, head_dim, block_size,
                                              lens, dtype, spare_blocks=1)
    expected = torch.empty(q.shape, dtype=torch.float64)
    for d, n in enumerate(lens.tolist()):
        first = max(0, n - window)
        rows = torch.arange(first, n)
        slots = tables[d, rows // block_size] * block_size + rows % block_size
        # The window's rows, in order, as one block of a pool of one.
        k, v = (cache.flatten(0, 1)[slots].unsqueeze(0) for cache in (k_cache, v_cache))
        expected[d] = _reference(q[d : d + 1], k, v, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([n - first]))[0]
    tables = _forget_before_window(k_cache, v_cache, tables, lens, window, block_size)
    ours = lib.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(head_dim), window)
    _check(ours, expected, dtype)

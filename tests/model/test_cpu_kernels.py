"""Our C kernels against torch's own operators, and the model's fast paths against the plain ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenline.model import cpu_kernels
from tokenline.model.attention import _gather_tables
from tokenline.model.layers import Linear

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (50, 100), (7, 33)])
def test_linear_bf16_matches_torch(rows: int, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    ours = kernels.linear_bf16(x, weight)
    reference = (x.float() @ weight.float().T).to(torch.bfloat16)
    torch.testing.assert_close(ours.float(), reference.float(), rtol=1.6e-2, atol=1e-2 * math.sqrt(in_features))
    # Float32 accumulation of exact bf16 products, as oneDNN does: mostly the same bits, never
    # more than a rounding step apart.
    torch.testing.assert_close(ours.float(), F.linear(x, weight).float(), rtol=8e-3, atol=1e-3)


@needs_kernels
def test_linear_bf16_rejects_wrong_inputs() -> None:
    with pytest.raises(ValueError):
        kernels.linear_bf16(torch.randn(2, 8), torch.randn(4, 8))  # float32
    with pytest.raises(ValueError):
        kernels.linear_bf16(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 9, dtype=torch.bfloat16))


def _reference_decode(q, k_cache, v_cache, tables, lens):
    keys, values = _gather_tables(k_cache, tables), _gather_tables(v_cache, tables)
    cols = torch.arange(tables.shape[1] * k_cache.shape[1])
    mask = (cols[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), keys.float(), values.float(), attn_mask=mask,
                                         enable_gqa=True)
    return out.squeeze(2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_seqs", "heads", "kv_heads", "head_dim", "block_size"),
    [(1, 9, 3, 64, 16), (7, 9, 3, 64, 16), (5, 8, 8, 128, 4), (3, 4, 2, 24, 8), (2, 12, 1, 64, 16)],
)
def test_decode_attention_matches_sdpa(dtype, num_seqs, heads, kv_heads, head_dim, block_size) -> None:
    """Vector path (head_dim a multiple of 16) and generic path (24), GQA groups 1 to 12."""
    generator = torch.Generator().manual_seed(num_seqs * heads + head_dim)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    lens = torch.randint(1, 12 * block_size, (num_seqs,), generator=generator)
    lens[0] = 1  # a sequence attending to its own single token
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:width] for _ in range(num_seqs)])
    q = torch.randn(num_seqs, heads, head_dim, generator=generator).to(dtype)
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()), 1 / math.sqrt(head_dim))
    reference = _reference_decode(q, k_cache, v_cache, tables, lens)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), reference, rtol=tolerance, atol=tolerance)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 40, 300])
def test_prepared_linear_agrees_with_plain_linear(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(576, 960, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain = layer(x)
        layer.prepare_for_inference()
        fast = layer(x)
    assert layer._packed is not None or not (torch.backends.mkldnn.is_available() and cpu_kernels.cpu_has_native_bf16())
    torch.testing.assert_close(fast.float(), plain.float(), rtol=1.6e-2, atol=1e-2)


def test_float32_linear_without_kernels_stays_plain(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # no compiler: the torch path, the plain weight
    layer = Linear(16, 8)
    x = torch.randn(3, 16)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.prepare_for_inference()
    assert layer._packed is None and layer._panels is None and layer._kernels is None and layer.weight is not None
    assert torch.equal(layer(x), expected)


def test_disabled_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("TOKENLINE_CPU_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        monkeypatch.delenv("TOKENLINE_CPU_KERNELS")
        cpu_kernels.load.cache_clear()


@needs_kernels
def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENLINE_HOME", str(tmp_path))
    first = cpu_kernels.build()
    assert first.exists() and first.parent == tmp_path / "kernels"
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == mtime  # no rebuild


def test_missing_compiler_falls_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENLINE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_same_with_and_without_kernels(default_model_dir, monkeypatch, dtype) -> None:
    """Greedy decoding on the real model: the C paths and the torch paths choose the same tokens."""
    if dtype == "bfloat16" and not cpu_kernels.cpu_has_native_bf16():
        # bf16 is emulated here and never served by default (auto is float32); the portable C builds
        # are held against a float64 reference in test_decode_attention_kernel.py instead.
        pytest.skip("bfloat16 is emulated on this CPU: the two bf16 paths round differently early on")
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0.0, max_tokens=24)

    def run() -> list[list[int]]:
        llm = LLM(default_model_dir, dtype=dtype, num_kv_blocks=64)  # a zero-filled 2 GiB pool costs seconds
        outputs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outputs]

    fast = run()
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    plain = run()
    if dtype == "float32":
        assert fast == plain
    else:
        # bfloat16 rounds attention outputs differently by one ulp here and there; a flip is only
        # acceptable late in a sequence, never at its start.
        for a, b in zip(fast, plain):
            assert a[:8] == b[:8]


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rms_norm_bf16_is_bit_identical_to_the_reference(tokens: int, monkeypatch) -> None:
    from tokenline.model.layers import RMSNorm

    generator = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(576, generator=generator).to(torch.bfloat16)
    x = (torch.randn(tokens, 576, generator=generator) * 3).to(torch.bfloat16)
    ours = norm(x)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert torch.equal(ours, norm(x))


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 33])
def test_rotary_bf16_is_bit_identical_to_the_reference(tokens: int) -> None:
    from tokenline.model.layers import RotaryEmbedding, apply_rotary

    heads, kv_heads, head_dim = 9, 3, 64
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(torch.bfloat16)
    positions = torch.randint(0, 4000, (tokens,), generator=generator)
    cos_sin = RotaryEmbedding(head_dim, 100000.0).lookup(positions, torch.bfloat16)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = apply_rotary(q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim), cos_sin)
    rotated = qkv.clone()
    kernels.rotary_bf16_(rotated, heads + kv_heads, head_dim, *cos_sin)
    got_q, got_k, got_v = rotated.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(got_q.reshape(tokens, heads, head_dim), want_q)
    assert torch.equal(got_k.reshape(tokens, kv_heads, head_dim), want_k)
    assert torch.equal(got_v, qkv[:, (heads + kv_heads) * head_dim :])  # values untouched


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 49152), (32, 49152), (7, 49155), (3, 5), (2, 17), (5, 16)])
def test_argmax_rows_is_torchs_max_index_first_on_ties(dtype: torch.dtype, rows: int, cols: int) -> None:
    """The greedy sampler's argmax: torch's index, the first of equal maxima, over a column slice of
    padded rows (as the sampler slices a padded vocabulary away), rows shorter than a vector included."""
    generator = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols + 64, generator=generator).to(dtype)[:, :cols]
    best = x.max(dim=-1).indices
    for r in range(rows):  # a tie after the maximum, and one before it in another row
        x[r, (best[r] + 3 + r) % cols] = x[r, best[r]]
    ours = kernels.argmax_rows(x)
    if ours is None:
        pytest.skip("this build has no vector argmax (torch's is used)")
    assert torch.equal(ours, x.max(dim=-1).indices)
    x[0] = float("-inf")  # a fully masked row: index 0, as torch
    assert kernels.argmax_rows(x)[0].item() == 0 == x.max(dim=-1).indices[0].item()

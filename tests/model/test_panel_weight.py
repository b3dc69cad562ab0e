"""One copy of each float32 linear weight on CPU: column panels, read by our outer-product kernel
below prefill sizes, unpacked for MKL past them, read by a tied embedding and by anyone who asks for
the plain weight back."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenline.model import cpu_kernels, panel_weight
from tokenline.model.layers import F32_PANEL_ROWS, Linear, PackedEmbedding, prepare_for_inference
from tests.model.test_packed_weight import TinyTied

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")

# The default model's projections, a partial last panel, and odd widths (no whole vector of inputs);
# 50 and 40 columns: a last pair of panels with a narrow second one, and an odd count of panels (the
# AVX-512 build takes panels in pairs).
SHAPES = [(960, 576), (576, 1536), (50, 100), (7, 33), (40, 300)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_pack_unpack_and_rows_give_back_the_weight(n: int, k: int) -> None:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    panels = panel_weight.pack(weight)
    assert panels.shape == (-(-n // 16), k, 16) and panels.is_contiguous()
    assert panels[-1, :, n - (panels.shape[0] - 1) * 16:].count_nonzero() == 0  # zero past N
    assert torch.equal(panel_weight.unpack(panels, n), weight)
    ids = torch.tensor([[0, n - 1], [n // 2, 1 % n]])
    assert torch.equal(panel_weight.rows(panels, ids), weight[ids])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 64, 300])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernel_matches_float64_and_a_row_is_the_same_bits_in_any_batch(rows: int, n: int, k: int) -> None:
    assert kernels is not None
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    panels = panel_weight.pack(weight)
    ours = kernels.linear_panels_f32(x, panels, n)
    reference = (x.double() @ weight.double().T).float()
    # float32 sums of k products: within a few roundings of the exact sum
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5 * math.sqrt(k))
    # Each output is one chain over k whatever the row tile: a row alone, or in a batch of another
    # size (a prefill chunk against a decode step), gives the same bits.
    for i in (0, rows - 1):
        assert torch.equal(kernels.linear_panels_f32(x[i : i + 1].contiguous(), panels, n)[0], ours[i])
    if rows > 1:
        assert torch.equal(kernels.linear_panels_f32(x[: rows - 1].contiguous(), panels, n), ours[: rows - 1])


@needs_kernels
def test_kernel_rejects_inputs_that_do_not_fit() -> None:
    assert kernels is not None
    panels = panel_weight.pack(torch.randn(20, 8))
    with pytest.raises(ValueError):
        kernels.linear_panels_f32(torch.randn(2, 8, dtype=torch.bfloat16), panels, 20)
    with pytest.raises(ValueError):
        kernels.linear_panels_f32(torch.randn(2, 9), panels, 20)  # another input width
    with pytest.raises(ValueError):
        kernels.linear_panels_f32(torch.randn(2, 8), panels, 40)  # more columns than the panels hold
    with pytest.raises(ValueError):
        kernels.linear_panels_f32(torch.randn(8, 2).T, panels, 20)  # not contiguous


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_holds_only_panels_and_takes_the_kernel_below_prefill_sizes(bias: bool, monkeypatch) -> None:
    layer = Linear(64, 40, bias=bias)
    weight = layer.weight.detach().clone()
    layer.prepare_for_inference()
    assert layer.weight is None and layer._panels is not None  # one copy: the panels
    assert torch.equal(layer.plain_weight(), weight)
    calls: list[int] = []
    original = layer._kernels.linear_panels_f32  # type: ignore[union-attr]
    monkeypatch.setattr(layer._kernels, "linear_panels_f32", lambda x, p, n: calls.append(x.shape[0]) or original(x, p, n))
    with torch.inference_mode():
        # a few rows; two prompts in one chunk; a long prefill chunk (MKL on a transient plain copy)
        for x in (torch.randn(3, 64), torch.randn(2, 100, 64), torch.randn(F32_PANEL_ROWS, 64)):
            torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [3, 200]
    assert layer.weight is None  # the plain copy was transient
    kept = Linear(64, 40, bias=False)
    kept.prepare_for_inference(keep_plain=True)
    assert kept.weight is not None and kept._panels is not None


@needs_kernels
def test_tied_head_and_embedding_share_the_panels(monkeypatch) -> None:
    model = TinyTied()
    table = model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[0, 5], [299, 17]])
    hidden = torch.randn(3, 64)
    with torch.inference_mode():
        logits = model.lm_head(hidden)
        prepare_for_inference(model)
        assert isinstance(model.embed_tokens, PackedEmbedding) and model.lm_head.weight is None
        assert list(model.parameters()) == []  # the matrix lives once, in the panels
        assert torch.equal(model.embed_tokens(ids), table[ids])
        torch.testing.assert_close(model.lm_head(hidden), logits, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("TOKENLINE_KEEP_PLAIN_WEIGHTS", "1")
    kept = TinyTied()
    prepare_for_inference(kept)
    assert isinstance(kept.embed_tokens, torch.nn.Embedding) and kept.lm_head.weight is kept.embed_tokens.weight

"""One copy of each bfloat16 linear weight: oneDNN's packed layout, read in place by our kernel,
by a tied embedding and by anyone who asks for the plain weight back."""

from __future__ import annotations

import pytest
import torch

from tokenline.model import cpu_kernels
from tokenline.model.layers import PACKED_BATCH_HINT, Linear, PackedEmbedding, prepare_for_inference
from tokenline.model.packed_weight import pack

needs_packing = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "data_ptr")
         and cpu_kernels.cpu_has_native_bf16()),
    reason="oneDNN packs bf16 weights only in this torch build on a CPU with native bf16",
)
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")

SHAPES = [(960, 576), (576, 1536), (100, 70), (33, 17), (49152, 64)]


@needs_packing
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_packed_layout_is_found_and_reads_back_exactly(n: int, k: int) -> None:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    packed = pack(weight, PACKED_BATCH_HINT)
    assert packed.layout is not None, "oneDNN chose a layout pack() does not recognise"
    assert torch.equal(packed.unpack(), weight)
    ids = torch.tensor([[0, n - 1], [n // 2, 1 % n]])
    assert torch.equal(packed.rows(ids), weight[ids])


@needs_packing
@needs_kernels
@pytest.mark.parametrize(("n", "k"), SHAPES[:4])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 31, 64])  # from 12 rows: the many-row path
def test_blocked_kernel_matches_the_float_product(n: int, k: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    packed = pack(weight, PACKED_BATCH_HINT)
    assert packed.layout is not None
    ours = cpu_kernels.load().linear_bf16_blocked(x, packed.tiles, n, packed.layout.block_n, packed.layout.pairs)
    reference = (x.float() @ weight.float().T).to(torch.bfloat16)
    # Same float32 accumulation as the plain-weight kernel, summed in another order.
    torch.testing.assert_close(ours.float(), reference.float(), rtol=1.6e-2, atol=2e-2)
    plain = cpu_kernels.load().linear_bf16(x, weight)
    torch.testing.assert_close(ours.float(), plain.float(), rtol=1.6e-2, atol=2e-2)


@needs_packing
@needs_kernels
def test_prepared_linear_keeps_one_copy(monkeypatch) -> None:
    torch.manual_seed(0)
    layer = Linear(576, 960, bias=False).to(torch.bfloat16)
    original = layer.weight.detach().clone()
    x = torch.randn(40, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
        layer.prepare_for_inference()
        assert layer.weight is None and list(layer.parameters()) == []
        assert torch.equal(layer.plain_weight(), original)
        for rows in (1, 2, 40):  # our kernel on the packed bytes, then oneDNN on them
            torch.testing.assert_close(layer(x[:rows]).float(), before[:rows].float(), rtol=1.6e-2, atol=1e-2)
    kept = Linear(576, 960, bias=False).to(torch.bfloat16)
    kept.prepare_for_inference(keep_plain=True)
    assert kept.weight is not None and kept._packed is not None


class TinyTied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(300, 64)
        self.lm_head = Linear(64, 300, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


@needs_packing
@needs_kernels
def test_tied_head_and_embedding_share_the_packed_copy(monkeypatch) -> None:
    model = TinyTied().to(torch.bfloat16)
    table = model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([0, 5, 299])
    hidden = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model.lm_head(hidden)
        prepare_for_inference(model)
        assert isinstance(model.embed_tokens, PackedEmbedding) and model.lm_head.weight is None
        assert list(model.parameters()) == []  # the matrix lives once, in the packed tiles
        assert torch.equal(model.embed_tokens(ids), table[ids])
        torch.testing.assert_close(model.lm_head(hidden).float(), logits.float(), rtol=1.6e-2, atol=1e-2)
    monkeypatch.setenv("TOKENLINE_KEEP_PLAIN_WEIGHTS", "1")
    kept = TinyTied().to(torch.bfloat16)
    prepare_for_inference(kept)
    assert isinstance(kept.embed_tokens, torch.nn.Embedding) and kept.lm_head.weight is kept.embed_tokens.weight


@needs_packing
@needs_kernels
def test_engine_tokens_same_with_one_copy_and_two(default_model_dir, monkeypatch) -> None:
    """Greedy bfloat16 decoding on the real model: serving from the packed weight alone picks the
    tokens the two-copy layout picks (the kernels sum in another order: a late flip is rounding)."""
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0.0, max_tokens=24)

    def run() -> list[list[int]]:
        llm = LLM(default_model_dir, dtype="bfloat16", num_kv_blocks=64)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    one_copy = run()
    monkeypatch.setenv("TOKENLINE_KEEP_PLAIN_WEIGHTS", "1")
    two_copies = run()
    for a, b in zip(one_copy, two_copies):
        assert a[:8] == b[:8]


def test_without_native_bf16_linears_keep_the_plain_weight(monkeypatch) -> None:
    """An AVX2-only CPU: oneDNN would refuse to pack (a crash at load before), so the layer keeps its
    plain weight and F.linear, and ``auto`` serves float32."""
    from tokenline.model.loader import resolve_dtype

    monkeypatch.setattr(cpu_kernels, "cpu_has_native_bf16", lambda: False)
    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight)
    prepare_for_inference(layer)
    assert layer._packed is None and layer.weight is not None
    assert torch.allclose(layer(x).float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16

"""Weight-only quantization (model/quantization.py, tl_linear_q): ggml's blocks reproduced byte for
byte, the kernel against float64 on the dequantized weights (vector and portable builds), the packed
panels (pack_panels, tl_linear_qp) within their activations' int8 rounding, and the default model
served from Q4_1 blocks picking the float32 model's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tokenline.llm import LLM
from tokenline.model import cpu_kernels
from tokenline.model.layers import QUANTIZED_BF16_DEQUANT_ROWS, QUANTIZED_GEMV_ROWS, Linear, QuantizedEmbedding
from tokenline.model.quantization import BLOCK_BYTES, QUANTIZATIONS, QuantizedWeight, pack_panels, quantize
from tokenline.sampling_params import SamplingParams
from tokenline.store.model_store import default_gguf_path

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


def test_requantizing_the_default_gguf_gives_back_its_own_blocks() -> None:
    """The default model's file, dequantized (as the importer does) and quantized again, is the
    file's bytes: tokenline serves the blocks llama.cpp serves. The first and last layers' Q4_1
    tensors and the Q8_0 embedding here (all 211 were checked once by hand; the whole file takes
    ~10 s more)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(default_gguf_path())
    seen = {"Q4_1": 0, "Q8_0": 0}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in seen or not tensor.name.startswith(("blk.0.", "blk.29.", "token_embd")):
            continue
        fmt = kind.lower()
        raw = torch.from_numpy(np.array(tensor.data)).reshape(-1, tensor.data.shape[-1])
        k = raw.shape[1] // BLOCK_BYTES[fmt] * 32
        ours = QuantizedWeight(fmt, raw, raw.shape[0], k).dequantize()
        if seen[kind] == 0:  # our dequantization is gguf's (the importer's), checked on one of each
            theirs = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            assert torch.equal(ours, torch.from_numpy(theirs).reshape(ours.shape))
        assert torch.equal(quantize(ours, fmt).blocks, raw), tensor.name
        seen[kind] += 1
    assert seen == {"Q4_1": 14, "Q8_0": 1}  # two layers' seven linears; the tied embedding/head


def test_the_engine_config_accepts_exactly_these_formats() -> None:
    from tokenline.engine.config import QUANTIZATIONS as ENGINE_NAMES

    assert ENGINE_NAMES == QUANTIZATIONS


@pytest.mark.parametrize("fmt", QUANTIZATIONS)
def test_quantize_round_trip_and_layout(fmt: str) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(7, 96, generator=generator)
    weight[2, :32] = 0.0  # an all-zero block: scale 0, no division by it
    q = quantize(weight, fmt)
    assert q.blocks.dtype == torch.uint8 and q.blocks.shape == (7, 3 * BLOCK_BYTES[fmt])
    back = q.dequantize()
    assert torch.equal(back[2, :32], torch.zeros(32))
    blocks = weight.reshape(7, 3, 32)
    # the grid's step: (max - min) / 15 for Q4_1, max|w| / 127 for Q8_0; rounding errs by half of it
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15 if fmt == "q4_1" else blocks.abs().amax(-1) / 127
    assert ((back - weight).abs().reshape(7, 3, 32).amax(-1) <= step * 0.5 + 1e-3).all()
    assert torch.equal(q.rows(torch.tensor([[4, 0]])), back[[4, 0]].unsqueeze(0))
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize(torch.randn(4, 40), fmt)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(weight, "awq")


def _check_kernel(lib: cpu_kernels.CpuKernels) -> None:
    generator = torch.Generator().manual_seed(0)
    for fmt in QUANTIZATIONS:
        # rows read in place (1-4: the fused layer's; 6: two row groups), through dequantized tiles
        # (9, 37: odd rows); odd column counts (tails)
        # the batched bfloat16 kernel: panels of 16 outputs with a partial last one, row tiles of up to 8
        for m, n, k in [(1, 576, 576), (2, 49, 64), (3, 1536, 576), (4, 101, 1536), (6, 33, 64), (9, 50, 96),
                        (37, 21, 64), (32, 960, 576), (17, 16, 32)]:
            w = torch.randn(n, k, generator=generator) * 0.05
            x = torch.randn(m, k, generator=generator)
            q = quantize(w, fmt)
            got = lib.linear_q(x, q.blocks, q.code, n)
            exact = x.double() @ q.dequantize().double().T
            assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 2e-6, (fmt, m, n, k)
            # bfloat16 rows (a bfloat16 model's): the same exact products, against the rows as given
            xb = x.bfloat16()
            got = lib.linear_q_bf16(xb, q.blocks, q.code, n)
            exact = xb.double() @ q.dequantize().double().T
            assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 2e-6, (fmt, m, n, k, "bf16")


@needs_kernels
def test_kernel_matches_float64_on_the_dequantized_weight() -> None:
    assert kernels is not None
    _check_kernel(kernels)
    for fmt in QUANTIZATIONS:  # the prefill path's dequantization is ggml's, bit for bit
        q = quantize(torch.randn(50, 96), fmt)
        assert torch.equal(kernels.dequantize_q(q.blocks, q.code, 50, 96), q.dequantize())
    q = quantize(torch.randn(8, 64), "q4_1")
    with pytest.raises(ValueError):
        kernels.linear_q(torch.randn(2, 96), q.blocks, q.code, 8)  # blocks of another width
    with pytest.raises(ValueError):
        kernels.linear_q(torch.randn(2, 64, dtype=torch.bfloat16), q.blocks, q.code, 8)
    with pytest.raises(ValueError):
        kernels.linear_q_bf16(torch.randn(2, 64), q.blocks, q.code, 8)  # float32 rows


@needs_kernels
def test_portable_build_matches_too() -> None:
    """Without AVX2 or F16C (the scalar loops, the software half-float conversion)."""
    try:
        lib = cpu_kernels.CpuKernels(cpu_kernels.build(extra_flags=("-mno-avx2", "-mno-f16c")))
    except Exception as exc:  # a compiler without these flags (not x86)
        pytest.skip(f"no portable x86 build here: {exc}")
    _check_kernel(lib)
    assert not lib.has_avx512vnni  # so nothing is packed for it: Linear keeps ggml's blocks


@needs_kernels
def test_build_without_avx512_bf16_matches_too() -> None:
    """AVX2 / AVX-512F without BF16 (an older EPYC): linear_q_bf16 widens the rows for the float kernels."""
    try:
        lib = cpu_kernels.CpuKernels(cpu_kernels.build(extra_flags=("-mno-avx512bf16",)))
    except Exception as exc:  # a compiler without this flag (not x86)
        pytest.skip(f"no such x86 build here: {exc}")
    assert not lib.has_avx512bf16
    _check_kernel(lib)
    try:  # nor VNNI: linear_qp is not built, and refuses rather than answering wrong
        lib = cpu_kernels.CpuKernels(cpu_kernels.build(extra_flags=("-mno-avx512bf16", "-mno-avx512vnni")))
    except Exception as exc:
        pytest.skip(f"no such x86 build here: {exc}")
    assert not lib.has_avx512vnni
    q = pack_panels(quantize(torch.randn(16, 64), "q8_0"))
    with pytest.raises(ValueError, match="VNNI"):
        lib.linear_qp(torch.randn(2, 64), q.blocks, q.code, 16)


@pytest.mark.parametrize("fmt", QUANTIZATIONS)
def test_packed_panels_hold_the_same_blocks(fmt: str) -> None:
    """pack_panels reorders the bytes (nothing added, nothing lost): lane j of a code vector holds 4
    consecutive inputs of row j; unpacking, dequantizing and row lookups give ggml's blocks' values."""
    generator = torch.Generator().manual_seed(5)
    q = quantize(torch.randn(48, 96, generator=generator), fmt)
    p = pack_panels(q)
    assert p.packed and p.blocks.shape == q.blocks.shape and not torch.equal(p.blocks, q.blocks)
    assert torch.equal(p.ggml_blocks(), q.blocks) and torch.equal(p.dequantize(), q.dequantize())
    ids = torch.tensor([[0, 47], [17, 17], [31, 5]])
    assert torch.equal(p.rows(ids), q.rows(ids))
    # row 21 (panel 1, lane 5), block 2, input 22 (group 5, byte 2 of the lane)
    chunk = p.blocks.view(3, 3, 16 * BLOCK_BYTES[fmt])[1, 2]
    if fmt == "q8_0":
        want = int(q.blocks[21, 2 * 34 + 2 + 22].view(torch.int8))
        assert int(chunk[32 + 64 * 5 + 4 * 5 + 2]) - 128 == want
    else:
        want = int(q.blocks[21, 2 * 20 + 4 + 22 - 16]) >> 4  # inputs 16-31: the high nibbles
        assert int(chunk[64 + 64 * (5 - 4) + 4 * 5 + 2]) >> 4 == want
    with pytest.raises(ValueError, match="panels of 16"):
        pack_panels(quantize(torch.randn(8, 32), fmt))


def _int8_rounding_bound(x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
    """[M, N]: how far rounding x to int8 per block of 32 (step max|x| / 127, half a step at most an
    input) can move x @ w.T: sum over blocks of max|x_b| / 254 times sum |d q| (Q4_1's minimum m
    multiplies the exact float sum of x_b, so only w - m = d q meets the rounded x)."""
    xb = x.double().reshape(x.shape[0], 1, -1, 32)
    wb = w.double().reshape(1, w.shape[0], -1, 32)
    if fmt == "q4_1":
        wb = wb - wb.amin(-1, keepdim=True)  # the quantizer's m is the block's minimum (its code 0)
    return (xb.abs().amax(-1) / 254 * wb.abs().sum(-1)).sum(-1)


@needs_kernels
def test_packed_kernel_is_within_the_activations_int8_rounding() -> None:
    """tl_linear_qp (the bfloat16 model's quantized linears): every row, panel and row tile (1-8 rows,
    balanced tiles past 8) within the bound the int8 rounding of x argues, of the float64 product on
    the dequantized weight, and on average within 2 % of the outputs (a wrong lane, group, scale or
    minimum is off by their size)."""
    assert kernels is not None
    if not kernels.has_avx512vnni:
        pytest.skip("no AVX-512 VNNI here: weights stay in ggml's blocks")
    generator = torch.Generator().manual_seed(6)
    for fmt in QUANTIZATIONS:
        for m, n, k in [(1, 576, 576), (3, 48, 64), (8, 960, 576), (9, 32, 1536), (32, 16, 96), (37, 64, 32)]:
            w = torch.randn(n, k, generator=generator) * 0.05 + (0.02 if fmt == "q4_1" else 0.0)  # minimums != 0
            q = quantize(w, fmt)
            dense = q.dequantize()
            for x in (torch.randn(m, k, generator=generator), torch.randn(m, k, generator=generator).bfloat16()):
                got = kernels.linear_qp(x, pack_panels(q).blocks, q.code, n).double()
                exact = x.double() @ dense.double().T
                bound = _int8_rounding_bound(x, dense, fmt)
                assert ((got - exact).abs() <= bound + 1e-5 * exact.abs() + 1e-6).all(), (fmt, m, n, k, x.dtype)
                # the bound is the worst case (|w| summed); typically the rounding moves outputs by ~0.6 %
                assert (got - exact).abs().mean() < 0.02 * exact.abs().mean(), (fmt, m, n, k, x.dtype)
    q = pack_panels(quantize(torch.randn(16, 64), "q4_1"))
    with pytest.raises(ValueError):
        kernels.linear_qp(torch.randn(2, 96), q.blocks, q.code, 16)  # blocks of another width


@needs_kernels
def test_packed_kernel_takes_prefill_chunks_row_by_row() -> None:
    """tl_linear_qp on a prefill chunk (hundreds to a thousand rows, the threads sharing the rows'
    quantization and then the panels): each row's outputs are bit for bit those of the row alone (so
    a prompt's numbers do not depend on how it is chunked or what shares its step), within the int8
    rounding bound of the float64 product on the dequantized weight."""
    assert kernels is not None
    if not kernels.has_avx512vnni:
        pytest.skip("no AVX-512 VNNI here: weights stay in ggml's blocks")
    generator = torch.Generator().manual_seed(8)
    for fmt in QUANTIZATIONS:
        n, k = 96, 192
        w = torch.randn(n, k, generator=generator) * 0.05 + (0.02 if fmt == "q4_1" else 0.0)
        q = quantize(w, fmt)
        packed, dense = pack_panels(q), q.dequantize()
        x = torch.randn(1029, k, generator=generator).bfloat16()
        got = kernels.linear_qp(x, packed.blocks, q.code, n)
        for lo, hi in [(0, 1), (5, 13), (500, 1029), (1028, 1029)]:
            assert torch.equal(kernels.linear_qp(x[lo:hi].contiguous(), packed.blocks, q.code, n), got[lo:hi]), (fmt, lo)
        exact = x.double() @ dense.double().T
        bound = _int8_rounding_bound(x, dense, fmt)
        assert ((got.double() - exact).abs() <= bound + 1e-5 * exact.abs() + 1e-6).all(), fmt


@needs_kernels
def test_bfloat16_linear_holds_only_packed_blocks_within_the_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 model's quantized Linear on a VNNI CPU holds its blocks packed (no other copy) and
    multiplies decode batches and prefill chunks of any length with tl_linear_qp (nothing unpacked
    or dequantized per call). Within the int8 rounding bound plus bfloat16's output rounding."""
    assert kernels is not None
    generator = torch.Generator().manual_seed(7)
    for fmt in QUANTIZATIONS:
        layer = Linear(256, 48, bias=False)
        layer.weight = torch.nn.Parameter(torch.randn(48, 256, generator=generator).bfloat16(), requires_grad=False)
        assert layer.quantize_(fmt) and layer.weight is None
        q = layer._quantized
        assert q is not None and q.packed == kernels.has_avx512vnni
        dense = layer.plain_weight()
        with monkeypatch.context() as patch:
            if q.packed:  # the packed kernel at every row count: no unpacked or dequantized copy, ever
                patch.setattr(QuantizedWeight, "ggml_blocks", _refuse_unpacking)
            for rows in (1, 4, 8, 32, 200, QUANTIZED_BF16_DEQUANT_ROWS + 3, 1100):
                x = torch.randn(rows, 256, generator=generator).bfloat16()
                y = layer(x).double()
                exact = x.double() @ dense.double().T
                bound = _int8_rounding_bound(x, dense, fmt) if q.packed else 0.0
                assert ((y - exact).abs() <= bound + exact.abs() * 2.0**-8 + 1e-3).all(), (fmt, rows)


def _refuse_unpacking(self: QuantizedWeight) -> torch.Tensor:
    raise AssertionError("a packed layer unpacked its blocks in a matrix product")


def test_bfloat16_decode_rows_through_quantized_linear_match_the_dequantized_weight() -> None:
    """A bfloat16 model's decode batches (1 to 64 rows) through a quantized Linear: within bfloat16's
    rounding of the output of the float64 product on the dequantized weight, whichever kernel runs."""
    generator = torch.Generator().manual_seed(3)
    for fmt in QUANTIZATIONS:
        layer = Linear(256, 40, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(40, 256, generator=generator))
        assert layer.quantize_(fmt)
        for rows in (1, 3, 4, 8, 32, 64, 200):  # decode batches, a prefill chunk
            x = torch.randn(rows, 256, generator=generator).bfloat16()
            y = layer(x)
            exact = x.double() @ layer.plain_weight().double().T
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
            # bfloat16's rounding is within 2^-8 of |y| (~16); a wrong panel, pair or scale is off by units
            assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-3).all(), (fmt, rows)


def test_linear_holds_only_blocks_and_falls_back_without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(1)
    layer = Linear(64, 10, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(10, 64, generator=generator))
        layer.bias.copy_(torch.randn(10, generator=generator))
    assert layer.quantize_("q8_0") and layer.weight is None
    # decode rows, rows through dequantized tiles, a prefill's rows (the whole matrix dequantized)
    for x in (torch.randn(2, 3, 64, generator=generator), torch.randn(40, 64, generator=generator),
              torch.randn(130, 64, generator=generator)):
        expected = torch.nn.functional.linear(x, layer.plain_weight(), layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(layer, "_kernels", None)  # no C compiler: dequantized per call
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert not Linear(40, 8).quantize_("q4_1")  # 40 inputs do not split into blocks of 32


def test_bfloat16_prefill_rows_multiply_in_bfloat16_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 model's long prefill chunk (QUANTIZED_BF16_DEQUANT_ROWS rows or more, where the
    batched kernel runs below it; QUANTIZED_GEMV_ROWS elsewhere) through quantized blocks: the weight
    dequantized and rounded to bfloat16 once, the product in bfloat16 on CPUs with native bf16
    (elsewhere in float32); either way within bfloat16's rounding of the float64 product."""
    generator = torch.Generator().manual_seed(2)
    layer = Linear(256, 48)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 256, generator=generator))
    assert layer.quantize_("q4_1")
    rows = max(QUANTIZED_GEMV_ROWS, QUANTIZED_BF16_DEQUANT_ROWS) + 3
    x = torch.randn(rows, 256, generator=generator).bfloat16()
    product_dtypes = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, w, b=None: product_dtypes.append(w.dtype) or linear(a, w, b))
    y = layer(x)
    native = cpu_kernels.load() is not None and cpu_kernels.cpu_has_native_bf16()
    assert product_dtypes == [torch.bfloat16 if native else torch.float32]
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 48)
    exact = x.double() @ layer.plain_weight().double().T
    # |y| ~ 16 (256 N(0, 1) products): bfloat16 steps there are 0.125; a wrong block or layout is off by units
    assert (y.double() - exact).abs().max().item() < 0.5
    assert (y.double() - exact).abs().mean().item() < 0.05


def _greedy(llm: LLM, prompts: list[str], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def test_default_model_from_q4_1_blocks_matches_float32(default_model_dir: Path) -> None:
    """The default model's weights are the GGUF's Q4_1 blocks dequantized, so serving the blocks
    must pick the float32 model's greedy tokens: at batch 1 and 3 (the fused decode layer) and 6
    (the torch operators with the quantized linears), prefill included."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Water boils at", "The three primary colours are", "import numpy as np\n"]
    plain = LLM(default_model_dir, dtype="float32", num_kv_blocks=128)
    expected = {1: _greedy(plain, prompts[:1], 24), 3: _greedy(plain, prompts[:3], 24), 6: _greedy(plain, prompts, 24)}
    del plain
    llm = LLM(default_model_dir, dtype="float32", num_kv_blocks=128, quantization="q4_1")
    model = llm.engine.runner.model
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.qkv_proj._quantized.fmt == "q4_1"
    assert model.lm_head._quantized.fmt == "q8_0" and isinstance(model.embed_tokens, QuantizedEmbedding)
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # no float matrix left
    for batch, want in expected.items():
        assert _greedy(llm, prompts[:batch], 24) == want, batch


def test_bfloat16_model_decodes_quantized_blocks_in_the_one_call_layer(default_model_dir: Path) -> None:
    """A bfloat16 model with --quantization: its decode steps run the one-call layer too (in float32,
    the norms widened), not ~30 torch operators a layer. Its embeddings, prefill and final norm stay
    bfloat16, so greedy paths may part from the float32 model's at a near tie; teacher-forced, the next
    token after each of the float32 model's prefixes agrees (measured 252 of 256 on 8 prompts with the
    exact kernels, 93 of these 96). On a VNNI CPU the projections' rows are also rounded to int8 per
    block of 32 (pack_panels, llama.cpp's rounding): 86 of 96 measured (Q8_0: 93 vs 90 exact), near
    ties only; a wrong kernel agrees on next to none."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Water boils at", "The three primary colours are", "import numpy as np\n"]
    plain = LLM(default_model_dir, dtype="float32", num_kv_blocks=128)
    expected = [(list(out.prompt_token_ids), list(out.outputs[0].token_ids)) for out in plain.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))]
    del plain
    llm = LLM(default_model_dir, dtype="bfloat16", num_kv_blocks=128, quantization="q4_1")
    model = llm.engine.runner.model
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    if cpu_kernels.load() is not None:
        assert model.fused_step_tokens() > 0  # None of the layers offered decode weights before
    agree = total = 0
    for prompt_ids, continuation in expected:
        for i, want in enumerate(continuation):
            out = llm.generate(prompt_ids + continuation[:i], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            agree += out[0].outputs[0].token_ids[0] == want
            total += 1
    assert agree / total >= 0.85, f"{agree} of {total} next tokens agree"


def test_bfloat16_quantized_prompt_gives_the_same_tokens_in_any_chunks(default_model_dir: Path) -> None:
    """A bfloat16 model under -q q8_0 prefills a 768-token prompt in one step of 1024 tokens (a chunk
    the layers once answered through a dequantized copy of each weight, other numbers than shorter
    chunks' int8 rows) or in chunks of 128 or 96 (none short enough for the one-call decode layer):
    the same greedy continuation each way, as every chunk now runs the packed kernel row by row."""
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hum a tune".split()
    outputs = []
    for budget in (1024, 128, 96):
        llm = LLM(default_model_dir, dtype="bfloat16", num_kv_blocks=128, quantization="q8_0",
                  max_num_batched_tokens=budget, enable_prefix_caching=False)
        if not outputs:
            text = " ".join(words[i * 7 % len(words)] for i in range(900))
            prompt = llm.tokenizer.encode(text)[:768]
            assert len(prompt) == 768
        [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        outputs.append(list(out.outputs[0].token_ids))
        del llm
    assert outputs[0] == outputs[1] == outputs[2]


def test_the_hybrid_model_serves_quantized(tiny_qwen3_5) -> None:  # noqa: ANN001 - conftest's factory
    """Qwen3.5's layout (DeltaNet and attention layers, an MTP-free head): every linear whose input
    splits into blocks of 32 is held quantized, the rest float, and generation runs end to end."""
    model_dir = tiny_qwen3_5()
    plain = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    want = _greedy(plain, ["Hello there", "1, 2, 3,"], 8)
    del plain
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=4, quantization="q8_0")
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all((m._quantized is not None) == (m.in_features % 32 == 0) for m in linears)
    assert any(m._quantized is not None for m in linears)
    got = _greedy(llm, ["Hello there", "1, 2, 3,"], 8)
    assert [len(t) for t in got] == [8, 8]
    # 8-bit weights move a random model's logits a little: the first tokens agree
    assert [t[0] for t in got] == [t[0] for t in want]

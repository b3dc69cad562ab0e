"""The one-call decode layer (cpu_kernels.decode_layer_: float32, quantized or packed bfloat16
weights) against the torch-operator layer it replaces, and the model's decode steps with and
without it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tokenline.model import cpu_kernels
from tokenline.model.attention import AttentionMetadata
from tokenline.model.batch import FUSED_DECODE_ROWS, ScheduledBatch, ScheduledSeq
from tokenline.model.config import ModelConfig
from tokenline.model.decoder import bf16_fused_rows
from tokenline.model.gemma3 import Gemma3DecoderLayer
from tokenline.model.layers import Attention, RMSNorm, RotaryEmbedding, prepare_for_inference, small_batch_rows
from tokenline.model.llama import LlamaDecoderLayer
from tokenline.model.quantization import pack_panels
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams
from tests.model.layer_calls import counted_decode_layer_calls

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")

BLOCK_SIZE = 16
NUM_BLOCKS = 192


def _config(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    )


def _random_layer(config: ModelConfig, generator: torch.Generator) -> LlamaDecoderLayer:
    layer = LlamaDecoderLayer(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.add_(1.0)
    return layer.eval()


def _decode_step(config: ModelConfig, rows: int, generator: torch.Generator):
    """x, positions, a filled KV cache, and the step's metadata: `rows` sequences of different lengths
    in scattered blocks, each decoding one token."""
    lens = [int(n) for n in torch.randint(1, 200, (rows,), generator=generator)]
    num_blocks = max(NUM_BLOCKS, 13 * rows)  # each row's up to 199 tokens in blocks of its own
    blocks = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    tables, slots = [], []
    for n in lens:
        own = [blocks.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables.append(own + [0] * (width - len(own)))
        slots.append(own[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim, generator=generator)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=rows, decode_block_tables=torch.tensor(tables),
        decode_context_lens=torch.tensor(lens), max_decode_context_len=max(lens),
    )
    cols = torch.arange(width * BLOCK_SIZE)
    meta.decode_mask = (cols[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]
    positions = torch.tensor(lens) - 1
    return torch.randn(rows, config.hidden_size, generator=generator), positions, kv, meta


def _fused(layer: LlamaDecoderLayer, x: torch.Tensor, cos_sin, kv: torch.Tensor, meta: AttentionMetadata):
    assert kernels is not None
    weights = layer.decode_weights()
    assert weights is not None
    cos, sin = (t.reshape(x.shape[0], -1).contiguous() for t in cos_sin)
    rows = cpu_kernels.DecodeRows(cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                  meta.max_decode_context_len)
    scratch = torch.empty(cpu_kernels.decode_layer_scratch(x.shape[0], weights))  # float32, whatever x's dtype
    out = x.clone()
    kernels.decode_layer_(out, weights, rows, kv[0], kv[1], scratch)
    return out


def _both_paths(layer: LlamaDecoderLayer, x: torch.Tensor, positions: torch.Tensor, cos_sin, kv: torch.Tensor,
                meta: AttentionMetadata):
    """The torch layer and the fused kernel, each on its own copy of the cache ``kv``:
    (torch output, fused output, torch's cache, the kernel's cache)."""
    kv_torch, kv_fused = kv.clone(), kv.clone()
    with torch.inference_mode():
        expected = layer(x.clone(), positions, cos_sin, kv_torch, meta)
        got = _fused(layer, x, cos_sin, kv_fused, meta)
    return expected, got, kv_torch, kv_fused


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 12])  # 12 default-model rows: SiLU on the threads
@pytest.mark.parametrize(
    "shape",
    # The default model's layer; odd sizes (vector tails, the generic attention path).
    [(576, 1536, 9, 3, 64), (100, 70, 4, 2, 24)],
)
def test_fused_layer_matches_torch_layer(rows: int, shape: tuple[int, ...]) -> None:
    config = _config(*shape)
    generator = torch.Generator().manual_seed(rows * 7 + shape[0])
    layer = _random_layer(config, generator)
    x, positions, kv, meta = _decode_step(config, rows, generator)
    rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
    cos_sin = rotary.lookup(positions, torch.float32)
    expected, got, kv_torch, kv_fused = _both_paths(layer, x, positions, cos_sin, kv, meta)
    # float32 in another summation order: the residual stream reaches ~60 here (an ulp of 4e-6), so
    # an element near 0 may sit a few ulps of the stream's scale from torch's.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=5e-6 * expected.abs().max().item())
    torch.testing.assert_close(kv_fused, kv_torch, rtol=1e-4, atol=1e-5)  # the rotated K and V written
    # The inputs make every part matter: a step one position off (RoPE) or without the residual
    # lands far outside the tolerance above.
    shifted = rotary.lookup(positions + 1, torch.float32)
    with torch.inference_mode():
        off_by_one = _fused(layer, x, shifted, kv.clone(), meta)
    assert (off_by_one - expected).abs().max() > 1e-2
    assert ((got - x) - expected).abs().max() > 1e-1


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shape", [(576, 1536, 9, 3, 64), (96, 160, 3, 1, 32)])
def test_fused_layer_reads_quantized_blocks_like_the_torch_layer(fmt: str, rows: int, shape: tuple[int, ...]) -> None:
    """--quantization: the one-call layer reads the same blocks the torch layer's linears do."""
    config = _config(*shape)
    generator = torch.Generator().manual_seed(rows + shape[0])
    layer = _random_layer(config, generator)
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.quantize_(fmt)
    weights = layer.decode_weights()
    assert weights is not None and weights.fmt == {"q4_1": 1, "q8_0": 2}[fmt]
    weights.check()
    x, positions, kv, meta = _decode_step(config, rows, generator)
    cos_sin = RotaryEmbedding(config.head_dim, config.rope_theta).lookup(positions, torch.float32)
    expected, got, kv_torch, kv_fused = _both_paths(layer, x, positions, cos_sin, kv, meta)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_fused, kv_torch, rtol=1e-4, atol=1e-5)
    assert ((got - x) - expected).abs().max() > 1e-1  # the residual matters at this tolerance


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_fused_layer_reads_packed_panels_like_the_torch_layer(fmt: str, rows: int) -> None:
    """A bfloat16 model's quantized weights on a VNNI CPU are packed (quantization.pack_panels): the
    one-call layer multiplies them with the kernel the torch layer's linears use (rows rounded to int8
    per block the same way), so the two paths agree as closely as with ggml's blocks."""
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_avx512vnni:
        pytest.skip("no AVX-512 VNNI here: nothing is packed")
    config = _config(96, 160, 3, 1, 32)
    generator = torch.Generator().manual_seed(rows + 11)
    layer = _random_layer(config, generator)
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.quantize_(fmt)
        linear._quantized = pack_panels(linear._quantized)  # as a bfloat16 weight's quantize_ leaves it
    weights = layer.decode_weights()
    assert weights is not None and weights.packed
    weights.check()
    x, positions, kv, meta = _decode_step(config, rows, generator)
    cos_sin = RotaryEmbedding(config.head_dim, config.rope_theta).lookup(positions, torch.float32)
    expected, got, kv_torch, kv_fused = _both_paths(layer, x, positions, cos_sin, kv, meta)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_fused, kv_torch, rtol=1e-4, atol=1e-5)
    assert ((got - x) - expected).abs().max() > 1e-1  # the residual matters at this tolerance


@needs_kernels
@pytest.mark.parametrize("rows", [1, 4])
def test_fused_layer_with_a_bfloat16_cache_matches_the_torch_layer(rows: int) -> None:
    """--kv-cache-dtype bfloat16: both paths round the new K/V into the cache and read it widened."""
    config = _config(576, 1536, 9, 3, 64)
    generator = torch.Generator().manual_seed(rows + 11)
    layer = _random_layer(config, generator)
    x, positions, kv, meta = _decode_step(config, rows, generator)
    cos_sin = RotaryEmbedding(config.head_dim, config.rope_theta).lookup(positions, torch.float32)
    expected, got, kv_torch, kv_fused = _both_paths(layer, x, positions, cos_sin, kv.bfloat16(), meta)
    with torch.inference_mode():
        float_cache = layer(x.clone(), positions, cos_sin, kv.clone(), meta)
    # K/V summed in another order can round to the neighbouring bfloat16 (one such element moves the
    # output by ~2.5e-3 here), far inside what the bfloat16 cache itself moves it (~0.16): the fused
    # output sits with the torch layer's on a bfloat16 cache, not with a float32 one.
    tolerance = 5e-5 * expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=tolerance)
    assert (got - float_cache).abs().max() > 10 * tolerance
    # The new rows: one bfloat16 rounding of K/V computed in another summation order.
    torch.testing.assert_close(kv_fused.float(), kv_torch.float(), rtol=2**-7, atol=1e-5)
    assert (kv_fused.view(torch.int16) != kv.bfloat16().view(torch.int16)).any()  # written through
    # The rounding shows, a little (relative to rows of magnitude ~30 here).
    assert 1e-6 < (expected - float_cache).abs().max() < 2e-2 * expected.abs().max()


def test_only_plain_layers_take_the_fused_path() -> None:
    config = _config(64, 96, 4, 2, 16)
    assert _random_layer(config, torch.Generator().manual_seed(0)).decode_weights() is not None
    qk_norm = LlamaDecoderLayer(config, Attention(config, qk_norm=RMSNorm))  # Qwen3's layer
    assert qk_norm.decode_weights() is None
    # bfloat16 only once its weights are packed in a layout the kernel reads (see the test below).
    assert LlamaDecoderLayer(config).to(torch.bfloat16).decode_weights() is None


def _packed_bf16_layer(config: ModelConfig, generator: torch.Generator) -> LlamaDecoderLayer:
    layer = _random_layer(config, generator).to(torch.bfloat16)
    prepare_for_inference(layer)
    return layer


@needs_kernels
@pytest.mark.skipif(not cpu_kernels.cpu_has_native_bf16(), reason="oneDNN packs bfloat16 weights only on native-bf16 CPUs")
# 13 and 33 rows: the streaming linear's many-row path, with row tiles of unequal sizes. Past
# small_batch_rows() (AMX only: it is the one-call layer's limit elsewhere) the torch layer takes oneDNN.
@pytest.mark.parametrize("rows", sorted({1, 2, 13, 33, small_batch_rows(),
                                         min(small_batch_rows() + 3, cpu_kernels.DECODE_LAYER_MAX_ROWS)}))
@pytest.mark.parametrize("shape", [(576, 1536, 9, 3, 64), (100, 70, 4, 2, 24)])
def test_bfloat16_fused_layer_is_the_torch_layer_bit_for_bit(rows: int, shape: tuple[int, ...]) -> None:
    """A bfloat16 model's one-call layer calls the kernels its per-operator path calls at a few rows
    (norm, the streaming linear over oneDNN's packed tiles, RoPE, the K/V write, attention, SiLU *
    up), rounding where torch's bfloat16 tensors round: the same bits, output and cache. Past those
    rows the torch layer multiplies with oneDNN (another summation order): within bfloat16 rounding."""
    config = _config(*shape)
    generator = torch.Generator().manual_seed(rows * 3 + shape[0])
    layer = _packed_bf16_layer(config, generator)
    weights = layer.decode_weights()
    assert weights is not None and weights.fmt == cpu_kernels.BF16_PACKED
    weights.check()
    x, positions, kv, meta = _decode_step(config, rows, generator)
    x, kv = x.bfloat16(), kv.bfloat16()
    cos_sin = RotaryEmbedding(config.head_dim, config.rope_theta).lookup(positions, torch.bfloat16)
    expected, got, kv_torch, kv_fused = _both_paths(layer, x, positions, cos_sin, kv, meta)
    assert got.dtype == torch.bfloat16
    if rows <= small_batch_rows():
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
        assert torch.equal(kv_fused.view(torch.int16), kv_torch.view(torch.int16))
    else:
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6 * scale)
    assert not torch.equal(kv_fused.view(torch.int16), kv.view(torch.int16))  # the new K/V written
    assert (got.float() - x.float() - expected.float()).abs().max() > 1e-1  # the residual matters
    shifted = RotaryEmbedding(config.head_dim, config.rope_theta).lookup(positions + 1, torch.bfloat16)
    with torch.inference_mode():
        off_by_one = _fused(layer, x, shifted, kv.clone(), meta)
    assert (off_by_one.float() - expected.float()).abs().max() > 1e-2  # RoPE's position matters


@needs_kernels
def test_decode_layer_rejects_rows_that_do_not_fit() -> None:
    assert kernels is not None
    config = _config(64, 96, 4, 2, 16)
    layer = _random_layer(config, torch.Generator().manual_seed(0))
    weights = layer.decode_weights()
    assert weights is not None
    x, positions, kv, meta = _decode_step(config, 2, torch.Generator().manual_seed(1))
    cos, sin = (t.reshape(2, -1) for t in RotaryEmbedding(16, 10000.0).lookup(positions, torch.float32))
    rows = cpu_kernels.DecodeRows(cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                  meta.max_decode_context_len)
    scratch = torch.empty(cpu_kernels.decode_layer_scratch(2, weights))
    with pytest.raises(ValueError):
        kernels.decode_layer_(x[:1], weights, rows, kv[0], kv[1], scratch)  # rows differ from the step's
    with pytest.raises(ValueError):
        kernels.decode_layer_(x, weights, rows, kv[0], kv[1], scratch[:10])
    with pytest.raises(ValueError):
        over = cpu_kernels.DECODE_LAYER_MAX_ROWS + 1  # over the row cap
        kernels.decode_layer_(torch.randn(over, 64), weights, rows, kv[0], kv[1], scratch)


@needs_kernels
def test_model_decode_steps_agree_with_the_torch_path(default_model_dir: Path) -> None:
    """The real default model: prompts prefilled and decoded at batch 1, 4 and 9 through the fused
    layers (every step of at most FUSED_DECODE_ROWS tokens: the prefill chunks too, whose tokens
    attend up to their own positions) pick the same greedy tokens as the torch path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared box each two-thread region waits for a descheduled thread
    try:
        _compare_paths(ModelRunner(default_model_dir, torch.float32))
    finally:
        torch.set_num_threads(threads)


def _compare_paths(runner: ModelRunner) -> None:
    per_seq = 8
    runner.allocate_kv_cache(2 * 9 * per_seq, BLOCK_SIZE)
    model = runner.model
    assert model.fused_decode_rows == FUSED_DECODE_ROWS
    sp = SamplingParams(temperature=0.0, max_tokens=64).with_defaults()
    generator = torch.Generator().manual_seed(3)
    for batch, (shortest, longest) in ((1, (5, 31)), (4, (3, 8)), (9, (8, 14))):
        prompts = [torch.randint(100, 40000, (int(n),), generator=generator).tolist()
                   for n in torch.randint(shortest, longest + 1, (batch,), generator=generator)]
        outputs = {}
        for path, fused_rows in (("torch", 0), ("fused", FUSED_DECODE_ROWS)):
            model.fused_decode_rows = fused_rows
            base = 0 if path == "torch" else 9 * per_seq
            tables = [list(range(base + i * per_seq, base + (i + 1) * per_seq)) for i in range(batch)]
            seqs = [list(p) for p in prompts]
            assert (sum(map(len, seqs)) <= FUSED_DECODE_ROWS) == (batch < 9)  # the prefill of 9 is too long
            runner.execute(ScheduledBatch([ScheduledSeq(f"s{i}", s, 0, tables[i], True, sp)
                                           for i, s in enumerate(seqs)]))
            for _ in range(8):
                out = runner.execute(ScheduledBatch([ScheduledSeq(f"s{i}", [s[-1]], len(s) - 1, tables[i], True, sp)
                                                     for i, s in enumerate(seqs)]))
                for i, s in enumerate(seqs):
                    s.append(out[f"s{i}"].token_id)
            outputs[path] = seqs
        assert outputs["fused"] == outputs["torch"], f"batch {batch}"


@needs_kernels
def test_mixed_small_steps_take_the_fused_path_and_agree(default_model_dir: Path) -> None:
    """One step of 1 decode row, a draft run (1 + 6 tokens, two drafts wrong) and a prompt chunk after
    a cached prefix, 12 tokens in all: the fused layers (every token a decode query up to its own
    position) and the torch path pick the same greedy token at every position, and the fused run
    really took the one-call layers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = ModelRunner(default_model_dir, torch.float32)
        per_seq = 4
        runner.allocate_kv_cache(2 * 3 * per_seq, BLOCK_SIZE)
        model = runner.model
        sp = SamplingParams(temperature=0.0, max_tokens=64).with_defaults()
        generator = torch.Generator().manual_seed(5)
        prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (9, 14, 20)]
        fused_layers = model._fused_layers_or_none()
        assert fused_layers is not None
        kernels = fused_layers[0]
        outputs = {}
        for path, fused_rows in (("torch", 0), ("fused", FUSED_DECODE_ROWS)):
            base = 0 if path == "torch" else 3 * per_seq
            tables = [list(range(base + i * per_seq, base + (i + 1) * per_seq)) for i in range(3)]
            model.fused_decode_rows = 0  # the same set-up on both sides: prompts through the torch path
            first = runner.execute(ScheduledBatch([
                ScheduledSeq("a", prompts[0], 0, tables[0], True, sp),
                ScheduledSeq("b", prompts[1], 0, tables[1], True, sp),
                ScheduledSeq("c", prompts[2][:16], 0, tables[2], False, sp),
            ]))
            a_next, b_next = first["a"].token_id, first["b"].token_id
            drafts = [b_next, 101, 202, b_next, 303, 404]  # the first is wrong at once, and so on
            model.fused_decode_rows = fused_rows
            with counted_decode_layer_calls(kernels) as calls:
                out = runner.execute(ScheduledBatch([
                    ScheduledSeq("a", [a_next], len(prompts[0]), tables[0], True, sp),
                    ScheduledSeq("b", [b_next, *drafts], len(prompts[1]), tables[1], True, sp,
                                 draft_token_ids=drafts),
                    ScheduledSeq("c", prompts[2][16:], 16, tables[2], True, sp),
                ]))
            outputs[path] = {k: (v.token_id, v.draft_targets) for k, v in out.items()}
            assert calls == ([12] * len(model.layers) if path == "fused" else [])
        assert outputs["fused"] == outputs["torch"]
        assert len(outputs["fused"]["b"][1]) == 6
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.skipif(not cpu_kernels.cpu_has_native_bf16(), reason="oneDNN packs bfloat16 weights only on native-bf16 CPUs")
def test_bfloat16_model_decodes_through_the_one_call_layers(default_model_dir: Path) -> None:
    """The real default model in bfloat16: decode steps of up to layers.small_batch_rows() sequences
    take the one-call layers (counted) and pick the same greedy tokens, with the same log-probs, as
    the per-operator path, whose kernels they call; the prompts are prefilled through the torch path
    on both sides."""
    runner = ModelRunner(default_model_dir, torch.bfloat16)
    model = runner.model
    fused_layers = model._fused_layers_or_none()
    assert fused_layers is not None and fused_layers[1][0].fmt == cpu_kernels.BF16_PACKED
    assert model.fused_step_tokens() == min(FUSED_DECODE_ROWS, bf16_fused_rows())
    kernels = fused_layers[0]
    per_seq, batch = 4, min(4, small_batch_rows())
    runner.allocate_kv_cache(2 * batch * per_seq, BLOCK_SIZE)
    sp = SamplingParams(temperature=0.0, max_tokens=64, logprobs=3).with_defaults()
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 40000, (int(n),), generator=generator).tolist() for n in (17, 30, 9, 24)[:batch]]
    outputs = {}
    try:
        for path, fused_rows in (("torch", 0), ("fused", FUSED_DECODE_ROWS)):
            base = 0 if path == "torch" else batch * per_seq
            tables = [list(range(base + i * per_seq, base + (i + 1) * per_seq)) for i in range(batch)]
            seqs = [list(p) for p in prompts]
            model.fused_decode_rows = 0
            runner.execute(ScheduledBatch([ScheduledSeq(f"s{i}", s[:-1], 0, tables[i], False, sp)
                                           for i, s in enumerate(seqs)]))
            model.fused_decode_rows = fused_rows
            steps = []
            with counted_decode_layer_calls(kernels) as calls:
                for _ in range(6):
                    out = runner.execute(ScheduledBatch([
                        ScheduledSeq(f"s{i}", [s[-1]], len(s) - 1, tables[i], True, sp) for i, s in enumerate(seqs)]))
                    steps.append([(out[f"s{i}"].token_id, out[f"s{i}"].logprobs) for i in range(batch)])
                    for i, s in enumerate(seqs):
                        s.append(out[f"s{i}"].token_id)
            outputs[path] = steps
            assert calls == ([batch] * 6 * len(model.layers) if path == "fused" else [])
    finally:
        model.fused_decode_rows = FUSED_DECODE_ROWS
    assert outputs["fused"] == outputs["torch"]
    assert all(lp is not None for step in outputs["torch"] for _, lp in step)  # log-probs compared too


# -- Gemma 3's layer: the same kernels with their options ------------------------------------------

GEMMA_WINDOW = 40  # shorter than most rows' contexts in _decode_step (1..199 tokens)


def _gemma_layer(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, sliding: bool,
                 generator: torch.Generator) -> Gemma3DecoderLayer:
    """A Gemma 3 layer with random weights: zero-centred norms of every kind (q/k norms too), GELU,
    a score scale other than 1/sqrt(head_dim), sliding (window GEMMA_WINDOW) or global."""
    config = ModelConfig(
        architecture="Gemma3ForCausalLM", vocab_size=64, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=4096, tie_word_embeddings=True,
        layer_types=["sliding_attention" if sliding else "full_attention"], sliding_window=GEMMA_WINDOW,
        raw={"query_pre_attn_scalar": 48, "hidden_activation": "gelu_pytorch_tanh"},
    )
    layer = Gemma3DecoderLayer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        for norm in (layer.input_layernorm, layer.pre_feedforward_layernorm, layer.self_attn.q_norm,
                     layer.self_attn.k_norm):
            norm.weight.add_(0.5)  # zero-centred: (1 + w) ~ 1.5
    return layer.eval()


def _gemma_both_paths(layer: Gemma3DecoderLayer, x: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                      meta: AttentionMetadata, dtype: torch.dtype):
    """The torch layer and the fused kernel (the meta's window as the runner's group metadata
    carries it), each on its own copy of ``kv``: (torch output, fused output, torch's cache, the kernel's)."""
    assert kernels is not None
    weights = layer.decode_weights()
    assert weights is not None
    weights.check()
    rotary = RotaryEmbedding(layer.self_attn.head_dim, 1_000_000.0)
    cos_sin = rotary.lookup(positions, dtype)
    kv_torch, kv_fused = kv.clone(), kv.clone()
    cos, sin = (t.reshape(x.shape[0], -1).contiguous() for t in cos_sin)
    rows = cpu_kernels.DecodeRows(cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                  meta.max_decode_context_len, layer.self_attn.window)
    scratch = torch.empty(cpu_kernels.decode_layer_scratch(x.shape[0], weights))
    got = x.clone()
    with torch.inference_mode():
        expected = layer(x.clone(), positions, cos_sin, kv_torch, meta)
        kernels.decode_layer_(got, weights, rows, kv_fused[0], kv_fused[1], scratch)
    return expected, got, kv_torch, kv_fused


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 12])
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "global"])
@pytest.mark.parametrize("shape", [(640, 2048, 4, 1, 256), (96, 160, 3, 1, 32)])  # Gemma 3 270M's layer; a small one
def test_gemma3_fused_layer_matches_torch_layer(rows: int, sliding: bool, shape: tuple[int, ...]) -> None:
    """Gemma 3's layer through the float32 one-call kernel: q/k norms before RoPE, norms after
    attention and the MLP, GELU, its score scale and (sliding) the window agree with the torch layer."""
    generator = torch.Generator().manual_seed(rows * 5 + shape[0] + sliding)
    layer = _gemma_layer(*shape, sliding=sliding, generator=generator)
    x, positions, kv, meta = _decode_step(_config(*shape), rows, generator)
    expected, got, kv_torch, kv_fused = _gemma_both_paths(layer, x, positions, kv, meta, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=5e-6 * expected.abs().max().item())
    torch.testing.assert_close(kv_fused, kv_torch, rtol=1e-4, atol=1e-5)
    # Each option matters: without any one of them (or the window, below) the output lands elsewhere.
    weights = layer.decode_weights()
    assert weights is not None
    for other in (dataclasses.replace(weights, gelu=False), dataclasses.replace(weights, post_attn_norm=None),
                  dataclasses.replace(weights, q_norm=None), dataclasses.replace(weights, scale=None)):
        out = x.clone()
        cos, sin = (t.reshape(rows, -1).contiguous()
                    for t in RotaryEmbedding(shape[4], 1_000_000.0).lookup(positions, torch.float32))
        step = cpu_kernels.DecodeRows(cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                      meta.max_decode_context_len, layer.self_attn.window)
        kernels.decode_layer_(out, other, step, kv.clone()[0], kv.clone()[1],  # type: ignore[union-attr]
                              torch.empty(cpu_kernels.decode_layer_scratch(rows, other)))
        assert (out - expected).abs().max() > 1e-3
    if sliding and int(meta.decode_context_lens.max()) > GEMMA_WINDOW:
        layer.self_attn.window = None
        with torch.inference_mode():
            unwindowed = layer(x.clone(), positions, RotaryEmbedding(shape[4], 1_000_000.0).lookup(
                positions, torch.float32), kv.clone(), meta)
        assert (unwindowed - got).abs().max() > 1e-3  # the window mattered


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 4])
def test_gemma3_fused_layer_reads_quantized_blocks_like_the_torch_layer(fmt: str, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows + 17)
    shape = (96, 160, 3, 1, 32)
    layer = _gemma_layer(*shape, sliding=True, generator=generator)
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.quantize_(fmt)
    x, positions, kv, meta = _decode_step(_config(*shape), rows, generator)
    expected, got, kv_torch, kv_fused = _gemma_both_paths(layer, x, positions, kv, meta, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_fused, kv_torch, rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.skipif(not cpu_kernels.cpu_has_native_bf16(), reason="oneDNN packs bfloat16 weights only on native-bf16 CPUs")
@pytest.mark.parametrize("rows", sorted({1, 2, 13, small_batch_rows()}))
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "global"])
def test_gemma3_bfloat16_fused_layer_is_the_torch_layer(rows: int, sliding: bool) -> None:
    """A bfloat16 Gemma 3 layer on oneDNN's packed tiles: its zero-centred norms scale in float32
    before the one rounding (float32 1 + w), GELU rounds where torch's two ops round; at a handful of
    rows every kernel is the torch layer's: (mostly) the same bits."""
    shape = (640, 2048, 4, 1, 256)
    generator = torch.Generator().manual_seed(rows * 3 + sliding)
    layer = _gemma_layer(*shape, sliding=sliding, generator=generator).to(torch.bfloat16)
    prepare_for_inference(layer)
    weights = layer.decode_weights()
    assert weights is not None and weights.fmt == cpu_kernels.BF16_PACKED and weights.f32_norms
    x, positions, kv, meta = _decode_step(_config(*shape), rows, generator)
    x, kv = x.bfloat16(), kv.bfloat16()
    expected, got, kv_torch, kv_fused = _gemma_both_paths(layer, x, positions, kv, meta, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # The rounding scheme is torch's: most rows come out the same bits. A sum over a norm's row in
    # another order than torch's can flip one rounding, and that row then moves by bfloat16 ulps.
    same_rows = (got.view(torch.int16) == expected.view(torch.int16)).all(-1).float().mean().item()
    assert same_rows >= 0.75, f"{same_rows:.0%} of the rows are the torch layer's bits"
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6 * scale)
    torch.testing.assert_close(kv_fused.float(), kv_torch.float(), rtol=2**-7, atol=2**-6)  # K/V are O(1) here
    assert (got.float() - x.float() - expected.float()).abs().max() > 1e-1  # the residual matters


def test_gemma3_layers_offer_decode_weights() -> None:
    """Gemma 3's layer runs in the one-call kernel (its norms folded to float32 1 + w); Qwen3's plain
    q/k norms are still refused."""
    layer = _gemma_layer(96, 160, 3, 1, 32, sliding=True, generator=torch.Generator().manual_seed(0))
    weights = layer.decode_weights()
    assert weights is not None and weights.gelu and weights.scale == 48**-0.5
    assert weights.q_norm is not None and weights.post_ff_norm is not None
    torch.testing.assert_close(weights.input_norm, 1.0 + layer.input_layernorm.weight)
    torch.testing.assert_close(weights.k_norm, 1.0 + layer.self_attn.k_norm.weight)

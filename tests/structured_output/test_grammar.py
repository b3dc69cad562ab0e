"""The structured-output spec, its validation, the compiler and its cache, the per-request matcher
(masks, drafts, rollback, start_after_token_id) and the sampler's bitmask stage, on the default
model's real tokenizer and real llguidance."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenline.model.sampler import Sampler, SamplingMetadata, SamplingRow
from tokenline.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    StructuredOutputs,
)
from tokenline.structured_output.grammar import (
    MIN_GRAMMAR_BYTES,
    CompiledGrammar,
    GrammarCompiler,
    bitmask_words,
    fill_bitmasks,
    grammar_text,
    validate,
)

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def compiler(default_model_dir: Path) -> GrammarCompiler:
    return GrammarCompiler(default_model_dir / "tokenizer.json", VOCAB, [EOS])


def allowed(bitmask_row: np.ndarray) -> list[int]:
    return np.nonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little"))[0].tolist()


# --- the spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"regex": "a", "choice": ["a"]}, {"json": {}, "json_object": True}, {"start_after_token_id": 3}],
)
def test_exactly_one_constraint(kwargs: dict) -> None:
    with pytest.raises(SamplingParamsError) as info:
        StructuredOutputs(**kwargs)
    assert info.value.param == "structured_outputs"


def test_empty_choice_is_an_error() -> None:
    with pytest.raises(SamplingParamsError) as info:
        StructuredOutputs(choice=[])
    assert info.value.param == "structured_outputs.choice"


def test_key_is_canonical_and_kept_by_children() -> None:
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputs(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key() == b.key() != StructuredOutputs(json={"type": "object"}).key()
    assert StructuredOutputs(regex="a").key() != StructuredOutputs(grammar="a").key()
    assert StructuredOutputs(choice=["x"], start_after_token_id=5).key() == StructuredOutputs(choice=["x"]).key()
    params = SamplingParams(n=2, seed=1, structured_outputs=a).with_defaults({"temperature": 0.5})
    assert params.for_child(1).structured_outputs is a


@pytest.mark.parametrize(
    "spec,param",
    [
        (StructuredOutputs(json={"type": "frobnicate"}), "structured_outputs.json"),
        (StructuredOutputs(json='{"type": '), "structured_outputs.json"),
        (StructuredOutputs(json={"type": "object", "if": {"required": ["a"]}}), "structured_outputs.json"),
        (StructuredOutputs(regex="a(b"), "structured_outputs.regex"),
        (StructuredOutputs(grammar="start: missing_rule"), "structured_outputs.grammar"),
        (StructuredOutputs(grammar='start: "a" "unterminated'), "structured_outputs.grammar"),
    ],
)
def test_validate_names_the_field(spec: StructuredOutputs, param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        validate(spec)
    assert info.value.param == param
    assert str(info.value)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(json={"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}),
        StructuredOutputs(json_object=True),
        StructuredOutputs(regex=r"\d{3}-\d{4}"),
        StructuredOutputs(choice=["a b", "x|y", "(é)", "\\n", ""]),
        StructuredOutputs(grammar='start: "answer: " %json{"type": "integer"}'),
    ],
)
def test_validate_accepts(spec: StructuredOutputs) -> None:
    validate(spec)
    assert grammar_text(spec)


def test_grammar_module_does_not_import_torch() -> None:
    code = "import sys, tokenline.structured_output.grammar; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- compiler and matcher ------------------------------------------------------------------------


def test_cache_shares_compilations_and_counts_hits(compiler: GrammarCompiler) -> None:
    spec = StructuredOutputs(choice=["alpha", "beta"])
    first = compiler.submit(spec)
    hits = compiler.num_cache_hits
    assert compiler.submit(StructuredOutputs(choice=["alpha", "beta"], start_after_token_id=9)) is first
    assert compiler.num_cache_hits == hits + 1
    assert first.result(timeout=30).seconds >= 0
    assert compiler.compile_seconds


def test_failed_compilation_raises_with_param_and_is_not_cached(compiler: GrammarCompiler) -> None:
    spec = StructuredOutputs(regex="(unclosed")
    future = compiler.submit(spec)
    with pytest.raises(SamplingParamsError) as info:
        future.result(timeout=30)
    assert info.value.param == "structured_outputs.regex"
    assert compiler.submit(spec) is not future


class SizedCompiler(GrammarCompiler):
    """Grammars of a size the test names (a regex ``s<MiB>-...``), so eviction is exact."""

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        grammar = super().compile(spec)
        grammar.nbytes = int((spec.regex or "").split("-")[0][1:]) << 20
        return grammar


def test_cache_is_bounded_in_bytes_least_recently_used_first(default_model_dir: Path) -> None:
    compiler = SizedCompiler(default_model_dir / "tokenizer.json", VOCAB, [EOS], cache_bytes=10 << 20)
    a, b, c, d = (StructuredOutputs(regex=f"s3-{name}") for name in "abcd")
    for spec in (a, b, c):
        compiler.submit(spec).result(timeout=30)
    assert (compiler.num_cached, compiler.num_cached_bytes) == (3, 9 << 20)
    compiler.submit(a).result(timeout=30)  # a hit: a is now the most recently used
    # Room is made for d (3 MiB, as the last one) before it compiles: b, the least recently used, goes.
    compiler.submit(d).result(timeout=30)
    assert (compiler.num_cached, compiler.num_cached_bytes, compiler.num_evictions) == (3, 9 << 20, 1)
    compiles = len(compiler.compile_seconds)
    compiler.submit(a).result(timeout=30)
    compiler.submit(b).result(timeout=30)  # evicted: compiled again (and c goes)
    assert len(compiler.compile_seconds) == compiles + 1
    assert compiler.num_cached_bytes <= 10 << 20
    # An evicted grammar is freed at once, not at the garbage collector's next pass.
    gc.disable()
    try:
        evicted = weakref.ref(compiler.submit(StructuredOutputs(regex="s3-e")).result(timeout=30))
        compiler.submit(StructuredOutputs(regex="s9-f")).result(timeout=30)
        assert evicted() is None
    finally:
        gc.enable()
    # One grammar larger than the whole cache serves its request and is not kept.
    big = compiler.submit(StructuredOutputs(regex="s11-big")).result(timeout=30)
    assert big.nbytes == 11 << 20 and compiler.num_cached_bytes <= 10 << 20
    compiler.shutdown()


def test_tenants_never_share_a_compilation(compiler: GrammarCompiler) -> None:
    spec = StructuredOutputs(choice=["red", "green"])
    alice = compiler.submit(spec, "alice")
    assert compiler.submit(spec, "alice") is alice
    bob = compiler.submit(spec, "bob")
    assert bob is not alice  # compiled again: Bob cannot tell by the time that Alice asked for it
    assert bob.result(timeout=30) is not alice.result(timeout=30)


def test_a_grammar_counts_the_memory_its_lexer_took(compiler: GrammarCompiler) -> None:
    small = compiler.submit(StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}")).result(timeout=30)
    heavy = compiler.submit(StructuredOutputs(regex="((a{100}){100}){4}z")).result(timeout=30)
    assert MIN_GRAMMAR_BYTES <= small.nbytes < 2 << 20
    assert heavy.nbytes > 8 << 20  # ~18 MiB of lexer, built by compiling's first mask


def test_a_spec_past_the_grammar_limits_fails_with_its_field(compiler: GrammarCompiler) -> None:
    # Under llguidance's default limits this regex compiled and kept ~186 MiB; under ours its
    # lexer runs out of fuel within compiling's first step, so the caller gets a 400.
    future = compiler.submit(StructuredOutputs(regex="((a{100}){100}){100}z<tag>x1"))
    with pytest.raises(SamplingParamsError) as info:
        future.result(timeout=60)
    assert info.value.param == "structured_outputs.regex"
    assert "too complex" in str(info.value)


def test_choice_matches_literally(compiler: GrammarCompiler) -> None:
    tokenizer = compiler.tokenizer()
    grammar = compiler.submit(StructuredOutputs(choice=["x|y", "(é)", "a.b"])).result(timeout=30)
    for text in ("x|y", "(é)", "a.b"):
        state = grammar.new_state()
        assert state.accept(tokenizer.tokenize_str(text)) and state.terminated, text
    for text in ("x", "axb", "é"):
        state = grammar.new_state()
        assert not (state.accept(tokenizer.tokenize_str(text)) and state.terminated), text


def test_masks_drafts_and_rollback(compiler: GrammarCompiler) -> None:
    tokenizer = compiler.tokenizer()
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    state = compiler.submit(spec).result(timeout=30).new_state()
    text = tokenizer.tokenize_str('{"a":12}')
    assert state.num_valid(text) == len(text)
    assert state.num_valid(text[:2] + tokenizer.tokenize_str("zz")) == 2

    # Rows with drafts equal the rows of a matcher that really consumed them, and the matcher
    # ends where it began.
    drafts = text[:3]
    bitmask = np.zeros((4 + 1, bitmask_words(VOCAB)), dtype=np.int32)
    fill_bitmasks(bitmask, [(state, 0, drafts)])
    other = compiler.submit(spec).result(timeout=30).new_state()
    fill_bitmasks(bitmask, [(other, 4, ())])
    assert np.array_equal(bitmask[0], bitmask[4])
    reference = compiler.submit(spec).result(timeout=30).new_state()
    for i, token in enumerate(drafts):
        row = np.zeros((1, bitmask.shape[1]), dtype=np.int32)
        reference.fill(row, 0)
        assert np.array_equal(row[0], bitmask[i]), i
        assert token in allowed(bitmask[i])
        reference.accept([token])

    assert state.accept(text) and state.terminated
    row = np.zeros((1, bitmask.shape[1]), dtype=np.int32)
    state.fill(row, 0)
    assert allowed(row[0]) == [EOS]  # the grammar's end: only EOS
    state.rollback(1)
    assert not state.terminated


def test_start_after_token_id(compiler: GrammarCompiler) -> None:
    grammar = compiler.submit(StructuredOutputs(choice=["yes"])).result(timeout=30)
    tokenizer = compiler.tokenizer()
    state = grammar.new_state(start_after_token_id=7)
    assert not state.active
    assert state.accept(tokenizer.tokenize_str("free text, anything"))
    assert not state.active
    assert state.accept([7]) and state.active and not state.terminated
    assert state.accept(tokenizer.tokenize_str("yes")) and state.terminated


# --- the sampler's mask stage --------------------------------------------------------------------


def test_sampler_applies_bitmask_to_constrained_rows_only() -> None:
    vocab = 70  # three words, the last one partly beyond the vocabulary
    torch.manual_seed(0)
    logits = torch.randn(3, vocab + 6)  # padding columns beyond the vocabulary
    bitmask = np.zeros((2, bitmask_words(vocab)), dtype=np.int32)
    allowed_ids = [[5, 40, 69], [33]]
    for row, ids in enumerate(allowed_ids):
        for i in ids:
            bitmask[row, i // 32] |= np.int32(1 << (i % 32)) if i % 32 != 31 else np.int32(-(1 << 31))
    params = SamplingParams(temperature=0.0, logprobs=3).with_defaults()
    rows = [SamplingRow(params, [], [], None)] * 3
    metadata = SamplingMetadata.build(rows, vocab, torch.device("cpu"))
    metadata.grammar_rows = torch.tensor([0, 2])
    metadata.grammar_bitmask = torch.from_numpy(bitmask)
    out = Sampler(vocab)(logits, metadata)
    assert out.token_ids[0].item() == max(allowed_ids[0], key=lambda i: logits[0, i].item())
    assert out.token_ids[1].item() == logits[1, :vocab].argmax().item()
    assert out.token_ids[2].item() == 33
    # Logprobs are those of the masked distribution.
    assert out.logprobs[2].item() == pytest.approx(0.0, abs=1e-6)
    masked = logits[0, allowed_ids[0]].log_softmax(-1)
    assert sorted(out.top_logprobs[0].tolist(), reverse=True) == pytest.approx(sorted(masked.tolist(), reverse=True))
    assert set(out.top_logprob_ids[0].tolist()) == set(allowed_ids[0])


def test_bitmask_unpacking_numpy_and_torch_agree() -> None:
    from tokenline.model.sampler import _forbidden_numpy, _forbidden_torch

    rng = np.random.default_rng(0)
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(3, 5), dtype=np.int64).astype(np.int32))
    for vocab in (160, 150):
        assert torch.equal(_forbidden_numpy(bitmask, vocab), _forbidden_torch(bitmask, vocab))


def test_sampler_random_rows_only_sample_allowed_tokens() -> None:
    vocab = 100
    bitmask = np.zeros((8, bitmask_words(vocab)), dtype=np.int32)
    bitmask[:, 1] = 0b1011  # ids 32, 33, 35
    params = SamplingParams(temperature=1.5, top_p=0.99).with_defaults()
    metadata = SamplingMetadata.build([SamplingRow(params, [], [], None)] * 8, vocab, torch.device("cpu"))
    metadata.grammar_rows = torch.arange(8)
    metadata.grammar_bitmask = torch.from_numpy(bitmask)
    for _ in range(5):
        out = Sampler(vocab)(torch.randn(8, vocab), metadata)
        assert set(out.token_ids.tolist()) <= {32, 33, 35}

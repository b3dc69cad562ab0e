"""Structured output through the offline API on real models and real llguidance: every output of
held-out JSON schemas parses and validates with ``jsonschema``, regex outputs fullmatch, choices
are chosen, Lark grammars hold; the grammar's end finishes with "stop"; the constraint starts after
``start_after_token_id``; preempted constrained requests keep their matcher in step; n-gram
speculation changes no greedy token. On SmolLM2 and on the random-weight tiny Qwen3.5 (hybrid),
whose unconstrained output is gibberish."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import TinyQwen3_5
from tokenline import LLM, SamplingParams
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.sampling_params import StructuredOutputs
from tokenline.spec_decode.ngram_proposer import NgramProposer

MAX_TOKENS = 160

# Held out: none of these shaped the implementation. Bounded lengths keep a gibberish model's
# strings and arrays inside MAX_TOKENS.
SCHEMAS: dict[str, dict] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 16},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_items": {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                       "minItems": 1, "maxItems": 5},
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -5, "maximum": 500},
            # multipleOf bounds the decimals: a plain "number" lets a gibberish model at temperature 1
            # write digits until max_tokens (valid by the grammar, cut by the length).
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
            "price": {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.5},
        },
        "required": ["count", "ratio"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "nickname": {"type": "string", "maxLength": 12},
            "active": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                                {"type": "string", "maxLength": 10}, {"type": "null"}]},
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "enum": ["a", "b"]}, "v": {"type": "boolean"}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
}
REGEXES = [r"\d{3}-\d{4}", r"(yes|no)( indeed)?", r"[A-Z][a-z]{2,8} [0-9]{1,2}"]
CHOICES = ["positive", "negative", "neutral ~ (maybe)"]
LARK = """
start: "The answer is " NUMBER "."
NUMBER: /[1-9][0-9]{0,2}/
"""
LARK_JSON = 'start: "result: " %json{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}'


def params_for(spec: StructuredOutputs, max_tokens: int = MAX_TOKENS) -> list[SamplingParams]:
    """Greedy, and two seeded samples at temperature 1 (the gibberish model's real test)."""
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)] + [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec) for seed in (1, 2)
    ]


def chat(llm: LLM, text: str) -> list[int]:
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def run_all(llm: LLM, prompt: str, specs: list[StructuredOutputs]) -> list[tuple[str, str]]:
    """(text, finish reason) for each spec's three parameter sets, all in one batch."""
    prompt_ids = chat(llm, prompt)
    params = [p for spec in specs for p in params_for(spec)]
    outputs = llm.generate([prompt_ids] * len(params), params)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


def check_json(results: list[tuple[str, str]], schemas: list[dict]) -> None:
    for i, (text, finish) in enumerate(results):
        schema = schemas[i // 3]
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)


def assert_pool_empty(llm: LLM) -> None:
    llm.engine.scheduler.check_integrity()
    pool = llm.engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


# --- SmolLM2 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(default_model_dir: Path) -> LLM:
    return LLM(default_model_dir, dtype="float32", num_kv_blocks=512, max_num_seqs=32)


def test_smollm2_json_schemas_all_validate(smol: LLM) -> None:
    results = run_all(smol, "Reply with a JSON record.", [StructuredOutputs(json=s) for s in SCHEMAS.values()])
    check_json(results, list(SCHEMAS.values()))
    stats = smol.engine.stats()
    assert stats.grammar_compile_count >= len(SCHEMAS)
    assert stats.grammar_cache_hits >= 2 * len(SCHEMAS)  # three requests per schema, one compilation
    assert_pool_empty(smol)


def test_smollm2_json_object_and_schema_as_text(smol: LLM) -> None:
    # Any object, greedy only: an unbounded grammar lets a sampled SmolLM2 nest objects forever.
    out = smol.generate([chat(smol, "Describe a cat as JSON.")],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                       structured_outputs=StructuredOutputs(json_object=True)))
    text = out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    results = run_all(smol, "Describe a cat as JSON.", [StructuredOutputs(json=json.dumps(SCHEMAS["enums"]))])
    check_json(results, [SCHEMAS["enums"]])


def test_smollm2_regex_choice_and_lark(smol: LLM) -> None:
    specs = [StructuredOutputs(regex=r) for r in REGEXES] + [
        StructuredOutputs(choice=CHOICES), StructuredOutputs(grammar=LARK), StructuredOutputs(grammar=LARK_JSON)
    ]
    results = run_all(smol, "Answer briefly.", specs)
    for i, (text, finish) in enumerate(results):
        assert finish == "stop", (text, finish)
        if i < 9:
            assert re.fullmatch(REGEXES[i // 3], text), (REGEXES[i // 3], text)
        elif i < 12:
            assert text in CHOICES
        elif i < 15:
            assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", text), text
        else:
            assert text.startswith("result: ") and isinstance(json.loads(text[len("result: "):])["ok"], bool), text


def test_smollm2_grammar_end_is_stop_even_with_ignore_eos(smol: LLM) -> None:
    spec = StructuredOutputs(choice=["yes", "no"])
    out = smol.generate([chat(smol, "Is water wet?")],
                        SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured_outputs=spec))
    completion = out[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
    assert len(completion.token_ids) <= 2


def test_smollm2_length_cut_is_length(smol: LLM) -> None:
    spec = StructuredOutputs(json=SCHEMAS["nested"])
    out = smol.generate([chat(smol, "A user, as JSON.")],
                        SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=spec))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5


def test_smollm2_constraint_starts_after_token(smol: LLM) -> None:
    prompt = chat(smol, "Tell me about the sea.")
    free = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].token_ids
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    spec = StructuredOutputs(choice=["SALT", "WAVES"], start_after_token_id=free[k])
    got = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=spec))
    ids = got[0].outputs[0].token_ids
    assert ids[: k + 1] == free[: k + 1]  # free text up to and including the start token
    assert smol.tokenizer.decode(ids[k + 1 :]) in ("SALT", "WAVES")
    assert got[0].outputs[0].finish_reason == "stop"


def use_engine(llm: LLM, speculative: bool, num_blocks: int, block_size: int = 4) -> None:
    """A fresh engine around the loaded model (and its grammar compiler)."""
    old = llm.engine
    runner = old.runner
    runner.allocate_kv_cache(num_blocks, block_size)
    llm.engine = EngineCore(
        runner,
        KVCacheManager(num_blocks, block_size, False),
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=runner.max_model_len),
        eos_token_ids=runner.config.eos_token_ids,
        check_integrity_every_step=True,
        proposer=NgramProposer(4, 2, 4) if speculative else None,
        grammar_compiler=old.grammar_compiler,
    )


PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick and polished the lens.",
    "To make the bread, mix the flour with warm water and a pinch of salt, then knead the dough for ten minutes.",
]
TEXT_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 400}, "words": {"type": "integer", "minimum": 0}},
    "required": ["text", "words"],
    "additionalProperties": False,
}


def test_smollm2_speculative_float32_identical_and_preemption(default_model_dir: Path) -> None:
    """Greedy constrained outputs are the same with and without n-gram drafts (float32), and under
    preemption from a tiny pool; drafts do get accepted inside the grammar."""
    llm = LLM(default_model_dir, dtype="float32", num_kv_blocks=64)
    prompts = [chat(llm, f"Repeat the following text exactly:\n\n{p}") for p in PASSAGES]
    prompts += [chat(llm, f"Repeat the following text exactly:\n\n{PASSAGES[1]}")]
    prompts += [chat(llm, "Return a user as JSON."), chat(llm, "Pick a sentiment.")]
    specs = [StructuredOutputs(regex=r"[A-Z][A-Za-z ,.]{10,300}")] * 2 + [
        StructuredOutputs(json=TEXT_SCHEMA),
        StructuredOutputs(json=SCHEMAS["nested"]),
        StructuredOutputs(regex=r"(positive|negative)( [a-z]{1,8}){0,6}"),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=s) for s in specs]

    use_engine(llm, speculative=False, num_blocks=512)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert_pool_empty(llm)
    texts = [llm.tokenizer.decode(ids) for ids in expected]
    for text, spec in zip(texts, specs):
        if spec.json is not None:
            jsonschema.validate(json.loads(text), spec.json)
    assert PASSAGES[0].split(".")[0] in texts[0]  # the model copies: drafts have something to match
    assert re.fullmatch(specs[0].regex, texts[0]) and re.fullmatch(specs[-1].regex, texts[-1])

    use_engine(llm, speculative=True, num_blocks=512)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert_pool_empty(llm)

    # Preemption: the pool holds about one and a half requests.
    for speculative in (False, True):
        use_engine(llm, speculative=speculative, num_blocks=48)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.stats().num_preemptions > 0
        assert_pool_empty(llm)


# --- tiny Qwen3.5 (hybrid, random weights) -------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> LLM:
    return LLM(qwen_dir, dtype="float32", max_num_seqs=32, num_kv_blocks=1024, block_size=4)


def test_qwen3_5_json_schemas_all_validate(qwen: LLM) -> None:
    results = run_all(qwen, "Reply with a JSON record.", [StructuredOutputs(json=s) for s in SCHEMAS.values()])
    check_json(results, list(SCHEMAS.values()))
    assert_pool_empty(qwen)


def test_qwen3_5_regex_choice_and_lark(qwen: LLM) -> None:
    specs = [StructuredOutputs(regex=r) for r in REGEXES] + [
        StructuredOutputs(choice=CHOICES), StructuredOutputs(grammar=LARK)
    ]
    results = run_all(qwen, "Answer briefly.", specs)
    for i, (text, finish) in enumerate(results):
        assert finish == "stop", (text, finish)
        if i < 9:
            assert re.fullmatch(REGEXES[i // 3], text), (REGEXES[i // 3], text)
        elif i < 12:
            assert text in CHOICES
        else:
            assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", text), text


def test_qwen3_5_preemption_keeps_matchers_in_step(qwen_dir: Path, qwen: LLM) -> None:
    specs = [StructuredOutputs(json=SCHEMAS[name]) for name in ("nested", "numbers", "array_of_objects", "any_of")]
    prompt = chat(qwen, "Reply with a JSON record.")
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=s) for s in specs]
    params += [SamplingParams(temperature=1.0, seed=5, max_tokens=64, structured_outputs=s) for s in specs]
    expected = [o.outputs[0].token_ids for o in qwen.generate([prompt] * len(params), params)]
    # A pool of 24 blocks of 4 holds about two of these requests; no prefix sharing.
    small = LLM(qwen_dir, dtype="float32", max_num_seqs=8, num_kv_blocks=24, block_size=4,
                enable_prefix_caching=False, check_integrity_every_step=True)
    got = small.generate([prompt] * len(params), params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == expected
    for o, p in zip(got, params):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), p.structured_outputs.json)
    assert_pool_empty(small)


def test_offline_bad_specs_and_engine_compile_failures_raise_naming_the_field(
    smol: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import Future

    from tokenline.frontend.processor import PromptError
    from tokenline.sampling_params import SamplingParamsError

    with pytest.raises(PromptError) as exc:  # refused by the processor, before any engine work
        smol.generate("x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="[a-")))
    assert exc.value.param == "structured_outputs.regex"
    # What the engine's compiler reports (a failure, or the bound passed) reaches the caller too.
    failed: Future = Future()
    failed.set_exception(SamplingParamsError("structured_outputs.grammar", "the compiler gave up"))
    monkeypatch.setattr(smol.engine.grammar_compiler, "submit", lambda spec, tenant=None: failed)
    with pytest.raises(PromptError, match="gave up") as exc:
        smol.generate("x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="[0-9]+")))
    assert exc.value.param == "structured_outputs.grammar"
    assert_pool_empty(smol)


def test_tokens_the_grammar_forces_are_appended_without_sampling_them(smol: LLM) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "role": {"enum": ["administrator", "user"]}}, "required": ["name", "role"],
              "additionalProperties": False}
    spec = StructuredOutputs(json=schema)
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=1, structured_outputs=spec)
    out = smol.chat([{"role": "user", "content": "A person as JSON."}], params)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)
    assert out.finish_reason == "stop"
    # `{"name":"` and `","role":"` are forced: fewer engine steps than tokens, one logprob per token,
    # and a forced token's logprob is 0 (probability 1 under the mask).
    assert out.timings is not None and out.timings.num_steps < len(out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert sum(1 for lp in out.logprobs if lp.logprob == 0.0) >= len(out.token_ids) - out.timings.num_steps
    assert_pool_empty(smol)

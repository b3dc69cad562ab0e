"""The grammar of forced tool calls, driven token by token on the default model's tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer

from tokenline.frontend.tool_calls import parse_tool_calls
from tokenline.frontend.tool_grammar import strict_schema, tool_call_grammar
from tokenline.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> LLTokenizer:
    return LLTokenizer(str(default_model_dir / "tokenizer.json"))


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def accepts(tokenizer: LLTokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole (and may end there)."""
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tokenizer.tokenize_str(text)) and matcher.is_accepting()


def sample(tokenizer: LLTokenizer, grammar: str, seed: int, limit: int = 400) -> str:
    """A random walk through the grammar: each token drawn uniformly from those it allows."""
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    rng = random.Random(seed)
    mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    out: list[int] = []
    for _ in range(limit):
        if matcher.is_stopped():
            break
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: tokenizer.vocab_size])
        token = int(rng.choice(allowed))
        if token == tokenizer.eos_token:
            break
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    assert matcher.is_accepting(), "the walk did not end its call"
    return tokenizer.decode_str(out)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name":"{name}","arguments":{arguments}}}\n</tool_call>'


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
NOW = tool("now")


def test_required_named_and_auto() -> None:
    assert tool_call_grammar([WEATHER, NOW], "auto") is None and tool_call_grammar([WEATHER, NOW], None) is None
    required = tool_call_grammar([WEATHER, NOW], "required")
    only_now = tool_call_grammar([WEATHER, NOW], named("now"))
    assert required is not None and only_now is not None
    assert "get_weather" in required and "get_weather" not in only_now
    for grammar in (required, only_now):
        assert '"<tool_call>"' in grammar and "whitespace_flexible" in grammar
        assert not LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar))
    # Markers the vocabulary holds as single added tokens are named by id, not spelled out.
    by_id = tool_call_grammar([WEATHER], "required", {"<tool_call>": 7, "</tool_call>": 8})
    assert by_id is not None and "<[7]>" in by_id and "<[8]>" in by_id and '"<tool_call>"' not in by_id


def test_calls_follow_their_tool_and_parse_back(tokenizer: LLTokenizer) -> None:
    required = tool_call_grammar([WEATHER, NOW], "required")
    assert required is not None
    two = call("get_weather", '{"city":"Oslo"}') + "\n" + call("now", "{}")
    assert accepts(tokenizer, required, two)
    assert not accepts(tokenizer, required, call("get_weather", "{}"))  # city is required
    assert not accepts(tokenizer, required, call("nope", "{}"))
    content, calls = parse_tool_calls(two)
    assert content == "" and [(c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("now", {})]


# Each of these failed before: the parameters were nested under a wrapper schema's "arguments",
# so "#..." pointed into the wrapper ("Pointer '/$defs/Seat' does not exist").
REFERENCES = {
    "$defs": {"type": "object", "properties": {"seats": {"type": "array", "items": {"$ref": "#/$defs/Seat"}}},
              "required": ["seats"], "$defs": {"Seat": {"type": "object", "properties": {"row": {"enum": [1, 2]}},
                                                        "required": ["row"]}}},
    "definitions": {"type": "object", "properties": {"seat": {"$ref": "#/definitions/Seat"}}, "required": ["seat"],
                    "definitions": {"Seat": {"enum": ["aisle", "window"]}}},
    "recursive": {"type": "object", "properties": {"kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
                  "required": ["kids"]},
    "into properties": {"type": "object", "properties": {"a": {"enum": ["x"]}, "b": {"$ref": "#/properties/a"}},
                        "required": ["a", "b"]},
}
GOOD = {"$defs": '{"seats":[{"row":1},{"row":2}]}', "definitions": '{"seat":"aisle"}',
        "recursive": '{"kids":[{"kids":[]},{"kids":[{"kids":[]}]}]}', "into properties": '{"a":"x","b":"x"}'}
BAD = {"$defs": '{"seats":[{"row":3}]}', "definitions": '{"seat":"middle"}', "recursive": '{"kids":[{}]}',
       "into properties": '{"a":"x","b":"y"}'}


@pytest.mark.parametrize("kind", list(REFERENCES))
def test_references_resolve_within_the_tools_own_schema(tokenizer: LLTokenizer, kind: str) -> None:
    grammar = tool_call_grammar([tool("f", REFERENCES[kind])], named("f"))
    assert grammar is not None
    assert accepts(tokenizer, grammar, call("f", GOOD[kind]))
    assert not accepts(tokenizer, grammar, call("f", BAD[kind]))


def test_only_declared_properties_unless_the_schema_says_otherwise(tokenizer: LLTokenizer) -> None:
    nested = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "integer"}}}, "tags": {"type": "object"}}}
    grammar = tool_call_grammar([tool("f", nested)], named("f"))
    assert grammar is not None
    assert accepts(tokenizer, grammar, call("f", '{"city":"Oslo","where":{"lat":1},"tags":{}}'))
    for extra in ('{"city":"Oslo","x":1}', '{"where":{"lat":1,"lon":2}}', '{"tags":{"a":1}}'):
        assert not accepts(tokenizer, grammar, call("f", extra)), extra
    # Said otherwise: additionalProperties true, or a schema for them.
    opened = {"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": True,
              "$defs": {}}
    typed = {"type": "object", "additionalProperties": {"type": "integer"}}
    for schema, text in ((opened, '{"city":"Oslo","x":[1]}'), (typed, '{"a":1,"b":2}')):
        grammar = tool_call_grammar([tool("f", schema)], named("f"))
        assert grammar is not None and accepts(tokenizer, grammar, call("f", text))
    # No parameters: a call without arguments.
    grammar = tool_call_grammar([NOW], named("now"))
    assert grammar is not None and accepts(tokenizer, grammar, call("now", "{}"))
    assert not accepts(tokenizer, grammar, call("now", '{"a":1}'))


def test_refining_subschemas_stay_open() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "anyOf": [{"properties": {"a": {"const": 1}}}, {"required": ["b"]}],
              "allOf": [{"type": "object", "properties": {"c": {"type": "object"}}}]}
    strict = strict_schema(schema)
    assert "additionalProperties" not in strict  # it has allOf beside its own keys
    assert all("additionalProperties" not in s for s in strict["anyOf"] + strict["allOf"])
    assert strict["allOf"][0]["properties"]["c"]["additionalProperties"] is False  # another value: closed
    assert "additionalProperties" not in schema["allOf"][0]["properties"]["c"]  # the caller's schema is untouched


def test_parallel_false_is_exactly_one_call(tokenizer: LLTokenizer) -> None:
    one = tool_call_grammar([WEATHER, NOW], "required", parallel=False)
    assert one is not None
    assert accepts(tokenizer, one, call("now", "{}"))
    assert not accepts(tokenizer, one, call("now", "{}") + "\n" + call("now", "{}"))
    matcher = LLMatcher(tokenizer, one, log_level=0)
    for token in tokenizer.tokenize_str(call("now", "{}")):
        assert matcher.consume_token(token)
    assert matcher.is_stopped()  # nothing may follow: the answer ends


NESTED = {"type": "object", "properties": {
    "party": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/Guest"}},
    "when": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 23}, {"enum": ["lunch", "dinner"]}]}},
    "required": ["party", "when"],
    "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                         "seat": {"$ref": "#/$defs/Seat"}}, "required": ["seat"]},
              "Seat": {"enum": ["aisle", "window"]}}}


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_are_valid_calls(tokenizer: LLTokenizer, seed: int) -> None:
    grammar = tool_call_grammar([tool("book", NESTED), NOW], "required", parallel=False)
    assert grammar is not None
    content, calls = parse_tool_calls(sample(tokenizer, grammar, seed))
    assert content == "" and len(calls) == 1
    if calls[0].name == "book":
        jsonschema.validate(json.loads(calls[0].arguments_json), {**NESTED, **strict_schema(NESTED)})
    else:
        assert calls[0].name == "now" and json.loads(calls[0].arguments_json) == {}


@pytest.mark.parametrize("parameters, fault", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/$defs/missing"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}, "unclosed group"),
    ({"type": "string"}, "object"),
    ("not a schema", "JSON schema object"),
])
def test_a_bad_schema_names_its_tool_not_the_grammar(parameters: Any, fault: str) -> None:
    tools = [NOW, {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    for choice in ("required", named("bad")):
        with pytest.raises(SamplingParamsError) as exc:
            tool_call_grammar(tools, choice)
        message = str(exc.value)
        assert exc.value.param == "tools[1].function.parameters" and fault in message, message
        assert "%json" not in message and "tool_call" not in message and "\n" not in message
    assert tool_call_grammar(tools, named("now")) is not None  # only the tools a grammar holds are compiled

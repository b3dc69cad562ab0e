"""The grammar of a forced tool call: ``tool_choice`` "required" or a named function.

The answer is made of calls in the format ``tool_calls.py`` parses,
``<tool_call>\\n{"name":"NAME","arguments":{...}}\\n</tool_call>``: exactly one for a named
function or ``parallel_tool_calls: false``, else one or more separated by newlines. The Lark
grammar (llguidance's dialect) spells out the JSON around the arguments, name first as the stream
parser expects, and gives each tool's ``parameters`` its own ``%json`` sub-grammar. A sub-grammar's
schema is its own root, so every reference resolves as in the tool's schema alone: ``#/$defs/X``,
``#/definitions/X``, ``#/properties/...`` and a recursive ``#``. (Nesting the parameters under a
wrapper schema's ``arguments`` moves the root; hoisting ``$defs`` to the wrapper would mend
``#/$defs/X`` only, and inlining references cannot express recursion.)

The arguments are an object that holds only the properties its schema declares, unless the schema
says otherwise (``additionalProperties``): what vLLM users get from xgrammar's strict mode, and
what keeps a weak model from inventing keys until it runs out of tokens.

Each schema is checked alone before it joins the grammar, so a bad one is the caller's 400 naming
``tools[i].function.parameters``, with llguidance's complaint and not the grammar around it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenline.frontend.tool_calls import TOOL_CALL_END, TOOL_CALL_START
from tokenline.sampling_params import SamplingParamsError
from tokenline.structured_output.grammar import json_schema_error

__all__ = ["arguments_schema", "strict_schema", "tool_call_grammar"]

# Compact JSON: free whitespace is where a weak model wanders off and never ends the call.
_JSON_OPTIONS = {"whitespace_flexible": False}
# A schema nested deeper than this is refused rather than walked (no request needs it).
_MAX_DEPTH = 64
_MAX_ERROR_CHARS = 300

# Where a schema holds subschemas that describe other values (a property's, an item's): strict.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems",)
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties",
               "unevaluatedItems", "contains", "propertyNames")
# Subschemas that refine the same value as their parent: closing them would forbid the keys the
# parent or a sibling declares (llguidance intersects them), so they are left as written.
_REFINING_ONE = ("not", "if", "then", "else")
_REFINING_MAPS = ("dependentSchemas",)


def tool_call_grammar(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any] | None,
    added_tokens: Mapping[str, int] | None = None,
    *,
    parallel: bool = True,
) -> str | None:
    """The Lark grammar of a forced answer: ``"required"`` calls to any of ``tools`` (one if not
    ``parallel``), a named function exactly one call to it; ``auto``/``none``: None, no grammar.
    ``added_tokens``: ids of the markers where the vocabulary has them as single added tokens
    (Qwen's ``<tool_call>``), which a grammar must name by id, not spell out. Raises
    ``SamplingParamsError`` naming ``tools[i].function.parameters`` for a schema that is bad."""
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        chosen = [next((i, f) for i, f in enumerate(functions) if f["name"] == wanted)]
        parallel = False
    elif tool_choice == "required":
        chosen = list(enumerate(functions))
    else:
        return None

    def marker(text: str) -> str:
        token_id = (added_tokens or {}).get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)  # JSON strings are Lark strings

    repeat = ' ("\\n" call)*' if parallel else ""
    lines = [
        f"start: call{repeat}",
        f'call: {marker(TOOL_CALL_START)} "\\n" body "\\n" {marker(TOOL_CALL_END)}',
        "body: " + " | ".join(f"call_{k}" for k in range(len(chosen))),
    ]
    for k, (i, function) in enumerate(chosen):
        schema = arguments_schema(function.get("parameters"), f"tools[{i}].function.parameters")
        head = '{"name":' + json.dumps(function["name"]) + ',"arguments":'
        lines.append(f'call_{k}: {json.dumps(head)} args_{k} "}}"')
        lines.append(f"args_{k}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def arguments_schema(parameters: Any, param: str) -> dict[str, Any]:
    """The schema a forced call's arguments follow: ``parameters`` made strict, an object at its
    root (no ``parameters``: no arguments, ``{}``), compact; checked, or ``SamplingParamsError(param)``."""
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise SamplingParamsError(param, "parameters must be a JSON schema object")
    kind = parameters.get("type")
    if kind is None or (isinstance(kind, list) and "object" in kind):
        parameters = {**parameters, "type": "object"}  # the arguments are an object, whatever else
    elif kind != "object":
        raise SamplingParamsError(param, f'parameters must describe an object ("type": "object"), not {kind!r}')
    schema = strict_schema(parameters, param)
    schema["x-guidance"] = _JSON_OPTIONS
    error = json_schema_error(schema)
    if error:
        raise SamplingParamsError(param, f"invalid JSON schema: {_one_line(error)}")
    return schema


def strict_schema(schema: dict[str, Any], param: str = "parameters") -> dict[str, Any]:
    """A copy of ``schema`` in which every object without ``additionalProperties`` (or
    ``unevaluatedProperties``) gets ``additionalProperties: false``. Left open: an object that
    only refines another (an ``allOf`` member; an ``anyOf``/``oneOf`` branch of an object with
    properties; ``if``/``then``/``else``, ``not``), and one with ``allOf`` or ``$ref`` beside its
    keys, since llguidance intersects those and a closed side would forbid the other's keys."""
    return _strict(schema, refining=False, depth=0, param=param)


def _strict(schema: Any, *, refining: bool, depth: int, param: str) -> Any:
    if not isinstance(schema, dict):
        return schema  # true/false schemas; anything else is llguidance's to refuse
    if depth > _MAX_DEPTH:
        raise SamplingParamsError(param, f"the schema is nested more than {_MAX_DEPTH} levels deep")

    def strict(sub: Any) -> Any:
        return _strict(sub, refining=False, depth=depth + 1, param=param)

    def open_(sub: Any) -> Any:
        return _strict(sub, refining=True, depth=depth + 1, param=param)

    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    if isinstance(out.get("items"), list):  # draft-07 tuples
        out["items"] = [strict(sub) for sub in out["items"]]
    for key in _REFINING_ONE:
        if isinstance(out.get(key), dict):
            out[key] = open_(out[key])
    for key in _REFINING_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: open_(sub) for name, sub in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [open_(sub) for sub in out["allOf"]]
    has_properties = isinstance(out.get("properties"), dict)
    for key in ("anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [open_(sub) if has_properties else strict(sub) for sub in out[key]]
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (kind is None and has_properties)
    said = "additionalProperties" in out or "unevaluatedProperties" in out
    if is_object and not said and not refining and "allOf" not in out and "$ref" not in out:
        out["additionalProperties"] = False
    return out


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_ERROR_CHARS else line[: _MAX_ERROR_CHARS - 1] + "…"

"""What a request constrains its output to (pure Python): one `GrammarSpec` per request.

The OpenAI and vLLM request fields (`response_format`, `structured_outputs`, `guided_*`) and the
enforced tool choices (`required`, a named function) all end up as one spec; engine/grammar.py
compiles it with llguidance. A spec is hashable: it is the key of the compiled-grammar cache, so
fifty requests with the same schema compile it once.

JSON schemas are strict, as OpenAI's strict mode and vLLM's default (xgrammar) read them: an object
that names its properties allows no others unless it says `additionalProperties` itself. JSON
Schema's own default (any other key allowed) lets a weak model add keys forever and never close
the object. llguidance has no option for it, so `strict_schema` writes the default in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpilot.runtime.server.json_text import load_object

GrammarKind = Literal["json_schema", "regex", "choice", "grammar", "lark"]

# The schema `{"type": "json_object"}` stands for: any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# Keywords whose value is a map of names to subschemas, and those whose value is a subschema or a
# list of them: where strict_schema looks for nested objects.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMAS = (
    "items", "prefixItems", "additionalItems", "contains", "additionalProperties",
    "propertyNames", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
)  # fmt: skip


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json_schema (text = the schema as canonical JSON), regex, choice (text = a JSON
    list of the allowed strings), grammar (Lark or GBNF, as vLLM's `grammar` field takes),
    lark (a Lark grammar kvpilot builds itself, e.g. for tool calls)."""

    kind: GrammarKind
    text: str
    # The request field it came from, for a 400 that names it; not part of the cache key.
    source: str = field(default="", compare=False)


def json_schema_spec(schema: dict[str, Any] | str, source: str) -> GrammarSpec:
    """A JSON-schema spec; the schema as a JSON object or its text (vLLM accepts both)."""
    if isinstance(schema, str):
        schema = load_object(schema, source, "a JSON schema (a JSON object)")
    if not isinstance(schema, dict):
        raise ValueError(f"{source}: a JSON schema must be a JSON object")
    return GrammarSpec("json_schema", canonical_json(strict_schema(schema)), source)


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` in which every object that names properties and does not say
    `additionalProperties` gets `additionalProperties: false`, at any depth. An object with
    `allOf` is left as written, and so are the allOf branches themselves: llguidance intersects
    them, so a property named in one branch would be forbidden by another."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema  # true, false, or a value that is not a schema
    strict = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            strict[key] = {name: strict_schema(sub) for name, sub in schema[key].items()}
    for key in SUBSCHEMAS:
        if key in schema and key != "allOf":
            strict[key] = strict_schema(schema[key])
    if isinstance(schema.get("allOf"), list):
        strict["allOf"] = [_strict_inside(branch) for branch in schema["allOf"]]
    names_properties = any(isinstance(schema.get(k), dict) for k in SCHEMA_MAPS[:2])
    if names_properties and "additionalProperties" not in schema and "allOf" not in schema:
        strict["additionalProperties"] = False
    return strict


def _strict_inside(branch: Any) -> Any:
    """An allOf branch: strict inside, its own additionalProperties as written."""
    strict = strict_schema(branch)
    if isinstance(branch, dict) and "additionalProperties" not in branch:
        strict.pop("additionalProperties", None)
    return strict


def regex_spec(pattern: str, source: str) -> GrammarSpec:
    if not pattern:
        raise ValueError(f"{source}: the regular expression is empty")
    return GrammarSpec("regex", pattern, source)


def choice_spec(choices: list[str], source: str) -> GrammarSpec:
    if not choices or any(not c for c in choices):
        raise ValueError(f"{source}: give at least one choice, none of them empty")
    return GrammarSpec("choice", json.dumps(choices, ensure_ascii=False), source)


def grammar_spec(text: str, source: str) -> GrammarSpec:
    if not text.strip():
        raise ValueError(f"{source}: the grammar is empty")
    return GrammarSpec("grammar", text, source)


def canonical_json(value: Any) -> str:
    """Spacing does not change the cache key; key order does, as it orders the output."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

"""Structured output in the request contract: what each `guided_*` field means, checked alike at every door,
and the grammar llguidance enforces for it.

A request carries at most one of `guided_json` (a JSON schema), `guided_regex`, `guided_grammar` (GBNF or
Lark) and `guided_choice` (a list of strings); `GrammarSpec` is that one, with the key the engine caches its
compiled grammar by. JSON is laid out as `json.dumps` writes it (", " and ": ", no other whitespace): one
layout means fewer tokens to choose from, no runs of whitespace a small model can loop on, and output that
the gateway's tool-call streaming can read as it arrives. An object schema that lists its `properties` takes
only those unless it says otherwise (`additionalProperties`), as OpenAI's strict mode and xgrammar's default
do: a model free to add properties can wander from key to invented key until max_tokens.

Why llguidance rather than xgrammar (measured on this machine: benchmarks/results/grammar_engines.md):
compiling a new JSON schema took 1.9 ms median (5.8 ms p99) against xgrammar's 14 ms (77 ms), which is the
time-to-first-token a new schema adds; per-token masks cost about the same in the median (6 vs 9 µs on
SmolLM2's 49k vocabulary); and it imports in 0.2 s without torch (xgrammar: 6.4 s with torch and tvm_ffi), so
the gateway, which never loads the engine, checks a schema with the very compiler the engine uses and
answers a bad one with a 400 before any work.

Stdlib only at import (llguidance is imported by the functions that need it): the gateway imports this module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_format.requests import InvalidRequest, json_depth_exceeds

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
MAX_SCHEMA_DEPTH = 64  # JSON nesting of a schema (checked before it is parsed)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR_CHARS = 400


@dataclass(frozen=True)
class GrammarSpec:
    """One request's grammar: the guided field it came in (errors name it) and its text (for guided_choice,
    the JSON list of the choices)."""

    field: str
    text: str

    @property
    def key(self) -> str:
        """What the engine caches the compiled grammar by: equal for equal grammars, whatever the request."""
        return hashlib.sha256(f"{self.field}\0{self.text}".encode()).hexdigest()


def guided_spec(values: Mapping[str, Any]) -> GrammarSpec | None:
    """The grammar that a request's field values ask for (None: the output is free); InvalidRequest naming the
    field when two are given or one is not what its field takes. The values' types and lengths are the
    contract fields' own checks; this adds what only structured output knows."""
    given = [name for name in GUIDED_FIELDS if values.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(given[1], f"give only one of {', '.join(GUIDED_FIELDS)} (got {given[0]} too)")
    field, value = given[0], values[given[0]]
    if field == "guided_choice":
        if not value:
            raise InvalidRequest(field, "must hold at least one string")
        return GrammarSpec(field, json.dumps(list(value)))
    if field == "guided_json":
        check_schema_text(value, field)
    return GrammarSpec(field, value)


def check_schema_text(text: str, field: str) -> dict[str, Any]:
    """A JSON schema's text parsed (bounded before parsing), or InvalidRequest naming `field`."""
    if json_depth_exceeds(text, MAX_SCHEMA_DEPTH):
        raise InvalidRequest(field, f"is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise InvalidRequest(field, f"is not valid JSON ({reason})") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(field, f"must be a JSON schema object (got {type(schema).__name__})")
    return schema


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The grammar definition llguidance's matcher takes for `spec` (not yet checked: `grammar_problem`, or the
    matcher's own error state). ValueError when the text cannot even be converted (a GBNF it cannot read)."""
    from llguidance import LLMatcher, grammar_from

    if spec.field == "guided_json":
        schema = closed_objects(json.loads(spec.text))
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
    if spec.field == "guided_regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.field == "guided_choice":
        choices = json.loads(spec.text)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return grammar_from("grammar", spec.text)  # GBNF (converted to Lark) or Lark


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists `properties` and says
    nothing about others (additionalProperties, patternProperties, unevaluatedProperties). A copy."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in (*_SCHEMA_ONES, "additionalProperties", "unevaluatedProperties"):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def grammar_problem(spec: GrammarSpec) -> str | None:
    """Why llguidance refuses `spec` (None: it compiles), without a tokenizer: what the gateway checks before
    any work. The engine compiles against its tokenizer and reports the same problems (grammar_error)."""
    from llguidance import LLMatcher

    try:
        grammar = llguidance_grammar(spec)
    except ValueError as exc:
        return short(str(exc))
    error = LLMatcher.validate_grammar(grammar)
    return short(error) if error else None


def short(message: str) -> str:
    """An engine's error message on one line, bounded (llguidance's show the grammar around the problem)."""
    text = " ".join(message.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"

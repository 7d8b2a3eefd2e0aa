"""Structured output and tool calling in OpenAI's request bodies: `response_format`, `tools`, `tool_choice`,
`parallel_tool_calls`, and trtserve's `guided_*` extras (vLLM's names), turned into the request contract's
fields (engine_format/grammars.py, engine_format/tool_calls.py) and checked before any work.

A schema, regex or grammar is checked here with llguidance, the compiler the engine uses (without the
model's tokenizer, which only the engine has): a bad one is a 400 naming the parameter and the problem.
Results are cached by text, so a client that sends the same schema every time pays the check once.

`response_format`: `json_object` constrains to any JSON object, `json_schema` to its schema (always enforced,
`strict` or not; objects take only their listed properties unless the schema says otherwise). `tools`:
rendered by the model's chat template (engine_format/tool_calls.py); `tool_choice` "none" leaves them out and
the text unparsed, "auto" (the default with tools) lets the model choose and parses any calls it writes,
"required" and a named function constrain the output to calls of those functions' schemas (one call, or
several with `parallel_tool_calls`, OpenAI's default).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from engine_format.grammars import GUIDED_FIELDS, GrammarSpec, grammar_problem, guided_spec
from engine_format.requests import FIELD, MAX_GRAMMAR_CHARS, InvalidRequest
from engine_format.tool_calls import FUNCTION_NAME, call_grammar
from runtime.gateway.errors import GatewayError
from runtime.gateway.strict import Strict


def bounds_of(name: str) -> Any:
    """pydantic's length bounds of a text field of the contract."""
    limits = FIELD[name].range
    assert limits is not None and limits.lo is not None and limits.hi is not None
    return Field(min_length=int(limits.lo), max_length=int(limits.hi))


GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
ChoiceText = Annotated[str, bounds_of("guided_choice")]
Choices = Annotated[list[ChoiceText], Field(min_length=1, max_length=FIELD["guided_choice"].max_items)]
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME.pattern)]


class JsonSchemaFormat(Strict):
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted; the schema is enforced either way


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise GatewayError.invalid("'json_schema' goes with type 'json_schema' (and only there)",
                                       "response_format.json_schema")  # fmt: skip
        return self


class FunctionDef(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class GuidedExtras(Strict):
    """trtserve's structured-output extras, on both endpoints (extra body fields, vLLM's names)."""

    guided_json: dict[str, Any] | GrammarText | None = None
    guided_regex: GrammarText | None = None
    guided_grammar: GrammarText | None = None
    guided_choice: (
        Annotated[list[ChoiceText], Field(min_length=1, max_length=FIELD["guided_choice"].max_items)] | None
    ) = None
    _guided: dict[str, str | list[str]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_guided(self) -> GuidedExtras:
        self._guided = self._extras()
        return self

    def guided(self) -> dict[str, str | list[str]]:
        """The contract's guided_* fields this body sends upstream (checked when it was validated)."""
        return self._guided

    def _extras(self) -> dict[str, str | list[str]]:
        """The guided_* extras set (at most one, and llguidance compiles it: a 400 otherwise)."""
        out: dict[str, str | list[str]] = {}
        for name in GUIDED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = json.dumps(value) if isinstance(value, dict) else value
        if len(out) > 1:
            first, second = list(out)[:2]
            raise GatewayError.invalid(f"give only one of {', '.join(GUIDED_FIELDS)} (got {first} too)", second)
        for name, value in out.items():
            check_grammar(name, json.dumps(value) if isinstance(value, list) else value, name)
        return out


MAX_CHECKED = 1024  # grammars whose check is remembered (by hash: a cache of texts would hold 128 MiB)
_checked: OrderedDict[str, str | None] = OrderedDict()


def check_grammar(field: str, text: str, param: str) -> None:
    """A 400 naming `param` unless the contract field `field` with `text` compiles."""
    problem = _problem(field, text)
    if problem is not None:
        raise GatewayError.invalid(f"'{param}': {problem}", param, "invalid_grammar")


def _problem(field: str, text: str) -> str | None:
    key = GrammarSpec(field, text).key
    if key in _checked:
        _checked.move_to_end(key)
        return _checked[key]
    try:
        spec = guided_spec({field: json.loads(text) if field == "guided_choice" else text})
        problem = None if spec is None else grammar_problem(spec)
    except InvalidRequest as exc:
        problem = str(exc).partition(": ")[2]
    _checked[key] = problem
    if len(_checked) > MAX_CHECKED:
        _checked.popitem(last=False)
    return problem


Guided = dict[str, str | list[str]]


def chat_guided(response_format: ResponseFormat | None, tools: list[Tool] | None, choice: ToolChoice | None,
                parallel: bool, extras: Guided) -> tuple[Guided, bool]:  # fmt: skip
    """A chat body's guided_* fields (its extras, its response_format, or a required tool call's grammar) and
    whether its output is to be parsed for tool calls; a 400 for a combination that cannot hold."""
    if choice is not None and not tools:
        raise GatewayError.invalid("'tool_choice' needs 'tools'", "tool_choice")
    guided = dict(extras)
    if response_format is not None and response_format.type != "text":
        if guided:
            raise GatewayError.invalid(f"give 'response_format' or '{next(iter(guided))}', not both",
                                       "response_format")  # fmt: skip
        schema = response_format.json_schema.schema_ if response_format.json_schema else None
        text = json.dumps(schema if schema is not None else {"type": "object"})
        check_grammar("guided_json", text, "response_format.json_schema.schema" if schema is not None
                      else "response_format")  # fmt: skip
        guided["guided_json"] = text
    if not tools or choice == "none":
        return guided, False
    for i, tool in enumerate(tools):  # a bad schema is refused even where no call is forced
        if tool.function.parameters is not None:
            check_grammar("guided_json", json.dumps(tool.function.parameters), f"tools[{i}].function.parameters")
    forced = _forced(tools, choice)
    if forced:
        if guided:
            raise GatewayError.invalid(f"a required tool call cannot be combined with '{next(iter(guided))}'",
                                       "tool_choice")  # fmt: skip
        grammar = call_grammar([_function(t) for t in forced], parallel)
        check_grammar("guided_grammar", grammar, "tools")
        guided["guided_grammar"] = grammar
    return guided, True


def _forced(tools: list[Tool], choice: ToolChoice | None) -> list[Tool]:
    """The tools a call is required of (none: the model may answer in text)."""
    if choice == "required":
        return tools
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise GatewayError.invalid(f"tool_choice names '{choice.function.name}', which is not among 'tools'",
                                       "tool_choice.function.name")  # fmt: skip
        return named
    return []


def _function(tool: Tool) -> dict[str, Any]:
    return tool.function.model_dump(exclude_none=True)


def upstream_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as the engine's chat template gets them (OpenAI's shape)."""
    return None if not tools else [{"type": "function", "function": _function(t)} for t in tools]

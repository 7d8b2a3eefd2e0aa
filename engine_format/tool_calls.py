"""Tool calling's text format, shared by the engine (which renders tools and past calls into the prompt) and
the gateway (which constrains and parses the calls the model writes).

A call is written as Hermes-style models (Qwen2.5, Hermes, SmolLM3) are trained to write it, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template renders `tools` itself gets the tools through its template (templates with tool
support expect exactly this block); any other model gets them in a system message, `system_prompt`, which
describes the same format (Qwen2.5's own wording). Results come back as `role: tool` messages; a template
without tool support sees them as user turns wrapped in <tool_response> tags, as Hermes templates render them.

When a call is required (OpenAI's tool_choice "required" or a named function), `call_grammar` is the Lark
grammar the request is constrained to: one block (or several, with parallel_tool_calls), each's JSON the
function's name and arguments valid against its parameters schema, laid out as engine_format/grammars.py
lays JSON out. Stdlib only: the gateway imports it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from engine_format.grammars import JSON_LAYOUT
from engine_format.requests import InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]]:
    """`tools` if it is a list of OpenAI function tools with distinct valid names, else InvalidRequest naming
    the first problem."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest(field, "must be a non-empty list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(field, f"has {len(tools)} tools; the limit is {MAX_TOOLS}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequest(f"{field}[{i}]", 'must be {"type": "function", "function": {"name": ...}}')
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise InvalidRequest(f"{field}[{i}].function.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise InvalidRequest(f"{field}[{i}].function.name", f"{name!r} is defined twice")
        names.add(name)
        if not isinstance(function.get("parameters", ANY_OBJECT), dict):
            raise InvalidRequest(f"{field}[{i}].function.parameters", "must be a JSON schema object")
    return tools


def system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system message that describes `tools` and the call format to a model whose template cannot."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CLOSE}"
    )


def call_text(name: str, arguments: str) -> str:
    """One call's block; `arguments` is the JSON text of the arguments object (OpenAI sends it as a string)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of `function` (an OpenAI tool's "function" object): its name, then its
    arguments valid against its parameters (any object when it declares none)."""
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function.get("parameters") or ANY_OBJECT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_grammar(functions: Sequence[dict[str, Any]], parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect: `%json` embeds a schema) of a required call to one of
    `functions`, or of one or more calls when `parallel`."""
    schemas = [call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    embedded = json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{OPEN}\\n" %json {embedded} "\\n{CLOSE}"\n'

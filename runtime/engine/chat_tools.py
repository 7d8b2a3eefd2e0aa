"""Chat prompts with tools: the messages of a tool-calling conversation checked and rendered for the model's
chat template (the call format, and why it is that one: engine_format/tool_calls.py).

A template that renders `tools` itself (its source uses the variable, as Qwen2.5's and Hermes' do) gets the
tools, past calls (`tool_calls` with their arguments as objects, as Hugging Face templates read them) and
`role: tool` results as they are. Any other template gets plain text it already knows how to render: the
tools in a system message (tool_calls.system_prompt), each past call written into its assistant message as
the model is asked to write it, and each result as a user turn in <tool_response> tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_format.requests import CHAT_ROLES, InvalidRequest
from engine_format.tool_calls import call_text, system_prompt

CALL_SHAPE = 'must be {"type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}'


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with the tools the model may call (None: a plain chat)."""

    messages: Sequence[dict[str, Any]]
    tools: list[dict[str, Any]] | None = field(default=None)


def check_messages(messages: Sequence[dict[str, Any]]) -> None:
    """InvalidRequest naming the first message that is not a chat message: a role of CHAT_ROLES, string content
    (an assistant message that only calls tools may have none), calls as OpenAI writes them."""
    for i, message in enumerate(messages):
        role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}]", f"needs 'role' (one of {', '.join(CHAT_ROLES)})")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise InvalidRequest(f"messages[{i}].tool_calls", "must be a list, on an assistant message")
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                        and isinstance(function.get("arguments"), str)):  # fmt: skip
                    raise InvalidRequest(f"messages[{i}].tool_calls[{j}]", CALL_SHAPE)
        if not isinstance(content, str) and not (content is None and calls):
            raise InvalidRequest(f"messages[{i}]", "needs string 'content' (or 'tool_calls' on an assistant message)")


def supports_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders `tools` itself."""
    return "tools" in (tokenizer.chat_template or "")


def render(tokenizer: Any, prompt: ChatPrompt) -> str:
    """The prompt's text through the model's chat template, ready for the assistant's turn."""
    native = supports_tools(tokenizer)
    if native:
        messages = [_native(m) for m in prompt.messages]
        tools = prompt.tools
    else:
        messages = _as_text(prompt.messages, prompt.tools)
        tools = None
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def _native(message: dict[str, Any]) -> dict[str, Any]:
    """A message as Hugging Face templates read it: content a string, call arguments an object."""
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**call, "function": {**call["function"], "arguments": _arguments(call)}}
                             for call in message["tool_calls"]]  # fmt: skip
    return out


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return call["function"]["arguments"]


def _as_text(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Messages of plain role and content: calls written out, results as user turns, tools in the system message."""
    out: list[dict[str, str]] = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": content})
    if tools:
        described = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out

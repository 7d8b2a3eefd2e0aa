"""OpenAI response bodies and stream chunks, built from upstream deltas.

`Choice` accumulates one choice's deltas; the functions below render choices as chat or
text-completion objects. Usage counts are the engine's (its prompt_tokens and
completion_tokens outputs), never re-tokenized here.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.gateway.errors import GatewayError
from runtime.gateway.tool_parser import CallDelta, ToolCallParser, parse_whole
from runtime.gateway.wire import Delta, TokenLogprob

Kind = Literal["chat", "text"]
_JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps(..., ensure_ascii=False), without an encoder per call


@dataclass
class Choice:
    index: int
    prompt_index: int  # which prompt it answers (completions take several); counts prompt tokens once each
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked: each prompt token scored (first None)

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.finish_reason = delta.finish_reason
        self.prompt_tokens, self.completion_tokens = delta.prompt_tokens, delta.completion_tokens
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def drop_completion(self) -> None:
        """Leave the generated text out (echo with max_tokens 0: the prompt scored, nothing generated)."""
        self.text, self.logprobs, self.completion_tokens = "", [], 0


@dataclass(frozen=True)
class Header:
    """What every object of one response shares."""

    kind: Kind
    model: str
    want_logprobs: bool
    tool_names: frozenset[str] | None = None  # the answer is parsed for calls of these (None: it is text)
    echo: tuple[str, ...] | None = None  # completions' `echo`: the prompts, each before its choices' text
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field in the answer
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def base(self, object_name: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": object_name, "created": self.created, "model": self.model}


def usage(choices: list[Choice]) -> dict[str, int]:
    prompt = sum(max((c.prompt_tokens for c in choices if c.prompt_index == p), default=0)
                 for p in {c.prompt_index for c in choices})  # fmt: skip
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(header: Header, choices: list[Choice]) -> dict[str, Any]:
    """The whole (non-streaming) response."""
    if header.kind == "chat":
        body = header.base("chat.completion")
        body["choices"] = [
            {"index": c.index, "logprobs": _logprobs(header, c.logprobs), **_message(header, c)} for c in choices
        ]
        if header.prompt_logprobs:  # (vLLM's place for chat: one prompt)
            body["prompt_logprobs"] = _vllm_prompt_logprobs(choices[0].prompt_logprobs if choices else None)
    else:
        body = header.base("text_completion")
        body["choices"] = [_text_choice(header, c) for c in choices]
    body["usage"] = usage(choices)
    return body


def _text_choice(header: Header, choice: Choice) -> dict[str, Any]:
    text, entries = choice.text, [_entry(lp) for lp in choice.logprobs]
    if header.echo is not None:
        prompt = header.echo[choice.prompt_index]
        text = prompt + text
        entries = _echoed(prompt, choice.prompt_logprobs) + entries
    out = {
        "index": choice.index,
        "text": text,
        "logprobs": _legacy_logprobs(entries) if header.want_logprobs else None,
        "finish_reason": choice.finish_reason,
    }
    if header.prompt_logprobs:
        out["prompt_logprobs"] = _vllm_prompt_logprobs(choice.prompt_logprobs)
    return out


def _message(header: Header, choice: Choice) -> dict[str, Any]:
    """A chat choice's message and finish reason: its text, or (tools) its content and calls."""
    if header.tool_names is None:
        return {"message": {"role": "assistant", "content": choice.text}, "finish_reason": choice.finish_reason}
    content, calls = parse_whole(choice.text, header.tool_names)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                  "arguments": c.arguments}} for c in calls]  # fmt: skip
    return {"message": message, "finish_reason": _call_finish(bool(calls), choice.finish_reason)}


def _call_finish(called: bool, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when the model called tools and stopped on its own."""
    return "tool_calls" if called and reason == "stop" else reason


class CompletionRender:
    """A chat or text completion: whole (`whole`), or as SSE events, one per upstream delta (chat's first
    chunk of a choice announces the role), then the usage chunk when asked for and [DONE] (`end`), or an
    error event (`failed`). What every chunk shares (id, object, created, model, and the usage null OpenAI
    puts on every chunk but the last when usage is asked for) is serialized once; a chunk is that text
    with its index, delta text, logprobs and finish reason spliced in, each serialized as json.dumps would
    inside the whole object: the result is byte for byte `sse(body)` of the chunk's dict (tests check)."""

    def __init__(self, header: Header, include_usage: bool, scores_only: bool = False) -> None:
        self.header, self.include_usage, self.scores_only = header, include_usage, scores_only
        self._parsers: dict[int, ToolCallParser] = {}  # per choice, when the answer is parsed for tool calls
        self._started: set[int] = set()  # choices whose first tool-parsed event went out
        base = _JSON.encode(header.base("chat.completion.chunk" if header.kind == "chat" else "text_completion"))
        self._head = f'data: {base[:-1]}, "choices": [{{"index": '  # the object left open
        self._tail = "}]" + (', "usage": null' if include_usage else "") + "}\n\n"
        if header.kind == "chat":
            self._first, self._next = ', "delta": {"role": "assistant", "content": ', ', "delta": {"content": '
            self._after_text = '}, "logprobs": '
        else:
            self._first = self._next = ', "text": '
            self._after_text = ', "logprobs": '

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        if self.scores_only:  # echo with max_tokens 0: the prompt scored, nothing generated
            for choice in choices:
                choice.drop_completion()
        return completion(self.header, choices)

    def end(self, choices: list[Choice]) -> str:
        return (usage_chunk(self.header, choices) if self.include_usage else "") + DONE

    def failed(self, exc: GatewayError) -> str:
        return exc.sse() + DONE

    def chunk(self, index: int, delta: Delta, first: bool) -> str:
        if self.header.tool_names is not None:
            return self._tool_chunks(index, delta)
        logprobs = "null" if not self.header.want_logprobs else _JSON.encode(_logprobs(self.header, delta.logprobs))
        finish = "null" if delta.finish_reason is None else _JSON.encode(delta.finish_reason)
        return (f"{self._head}{index}{self._first if first else self._next}{_JSON.encode(delta.text)}"
                f'{self._after_text}{logprobs}, "finish_reason": {finish}{self._tail}')  # fmt: skip

    def _tool_chunks(self, index: int, delta: Delta) -> str:
        """The events of one upstream delta of a choice parsed for tool calls (ToolCallParser): its content,
        then one event per call delta (a call's id and name, then its arguments' pieces), then the finish;
        the choice's first event carries the role. Empty when the parser holds everything back."""
        if index not in self._parsers:
            self._parsers[index] = ToolCallParser(self.header.tool_names or frozenset())
        parser = self._parsers[index]
        text, calls = parser.feed(delta.text)
        if delta.finish_reason is not None:
            text += parser.finish()[0]
        deltas: list[dict[str, Any]] = ([{"content": text}] if text else []) + [_call_delta(c) for c in calls]
        finish = None if delta.finish_reason is None else _call_finish(bool(parser.calls), delta.finish_reason)
        if finish is not None and not deltas:
            deltas = [{}]
        events = []
        for i, item in enumerate(deltas):
            if index not in self._started:
                item = {"role": "assistant", **item}
                self._started.add(index)
            body = self.header.base("chat.completion.chunk")
            body["choices"] = [{"index": index, "delta": item, "logprobs": None,
                                "finish_reason": finish if i == len(deltas) - 1 else None}]  # fmt: skip
            if self.include_usage:
                body["usage"] = None
            events.append(sse(body))
        return "".join(events)


def _call_delta(call: CallDelta) -> dict[str, Any]:
    if call.name is None:
        return {"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]}
    return {"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}]}  # fmt: skip


def usage_chunk(header: Header, choices: list[Choice]) -> str:
    body = header.base("chat.completion.chunk" if header.kind == "chat" else "text_completion")
    body["choices"] = []
    body["usage"] = usage(choices)
    return sse(body)


def sse(body: dict[str, Any]) -> str:
    return f"data: {_JSON.encode(body)}\n\n"


DONE = "data: [DONE]\n\n"


def _token_bytes(token: str) -> list[int] | None:
    return None if token.startswith("token_id:") else list(token.encode("utf-8"))


def _logprobs(header: Header, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
    if not header.want_logprobs:
        return None
    if header.kind == "chat":
        return {"content": [
            {"token": lp.token, "logprob": lp.logprob, "bytes": _token_bytes(lp.token),
             "top_logprobs": [{"token": t, "logprob": v, "bytes": _token_bytes(t)} for t, v in lp.top]}
            for lp in logprobs
        ]}  # fmt: skip
    return _legacy_logprobs([_entry(lp) for lp in logprobs])


# A legacy completions logprobs entry: the token's text, its logprob and its top alternatives (None: a prompt's
# first token, which nothing before it scores).
Entry = tuple[str, float | None, dict[str, float] | None]


def _entry(lp: TokenLogprob) -> Entry:
    return lp.token, lp.logprob, dict(lp.top)


def _legacy_logprobs(entries: list[Entry]) -> dict[str, Any]:
    """Legacy completions: parallel lists; text offsets are known only when tokens carry their text."""
    offsets, position = [], 0
    for token, _, _ in entries:
        offsets.append(position)
        position += 0 if token.startswith("token_id:") else len(token)
    return {
        "tokens": [token for token, _, _ in entries],
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [top for _, _, top in entries],
        "text_offset": offsets,
    }


def _echoed(prompt: str, scored: list[TokenLogprob | None] | None) -> list[Entry]:
    """The echoed prompt's entries (with `logprobs`, the prompt was scored): its first token's text is what
    the others' texts leave of the prompt, with no logprob (vLLM's and OpenAI's null)."""
    rest = [lp for lp in scored or [] if lp is not None]
    tail = "".join(lp.token for lp in rest)
    head = prompt[: len(prompt) - len(tail)] if prompt.endswith(tail) else ""
    return [(head, None, None), *(_entry(lp) for lp in rest)]


def _vllm_prompt_logprobs(scored: list[TokenLogprob | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, its id and its top alternatives' ids, each with its logprob,
    rank (known for the alternatives: their place) and text; None for the first token."""
    if scored is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in scored:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(token_id): {"logprob": v, "rank": rank, "decoded_token": t}
            for rank, (token_id, (t, v)) in enumerate(zip(lp.top_ids, lp.top, strict=True), start=1)
        }
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": None, "decoded_token": lp.token})
        out.append(entry)
    return out

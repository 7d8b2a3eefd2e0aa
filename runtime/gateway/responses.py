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

from runtime.gateway.upstream import Delta, TokenLogprob

Kind = Literal["chat", "text"]


@dataclass
class Choice:
    index: int
    prompt_index: int  # which prompt it answers (completions take several); counts prompt tokens once each
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.finish_reason = delta.finish_reason
        self.prompt_tokens, self.completion_tokens = delta.prompt_tokens, delta.completion_tokens
        self.logprobs.extend(delta.logprobs)


@dataclass(frozen=True)
class Header:
    """What every object of one response shares."""

    kind: Kind
    model: str
    want_logprobs: bool
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
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "logprobs": _logprobs(header, c.logprobs), "finish_reason": c.finish_reason}
            for c in choices
        ]  # fmt: skip
    else:
        body = header.base("text_completion")
        body["choices"] = [
            {"index": c.index, "text": c.text, "logprobs": _logprobs(header, c.logprobs),
             "finish_reason": c.finish_reason}
            for c in choices
        ]  # fmt: skip
    body["usage"] = usage(choices)
    return body


def chunk(header: Header, index: int, delta: Delta, first: bool, include_usage: bool) -> str:
    """One SSE event for one upstream delta (chat's first chunk of a choice announces the role)."""
    logprobs = _logprobs(header, delta.logprobs)
    if header.kind == "chat":
        body = header.base("chat.completion.chunk")
        message = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        body["choices"] = [{"index": index, "delta": message, "logprobs": logprobs,
                            "finish_reason": delta.finish_reason}]  # fmt: skip
    else:
        body = header.base("text_completion")
        body["choices"] = [{"index": index, "text": delta.text, "logprobs": logprobs,
                            "finish_reason": delta.finish_reason}]  # fmt: skip
    if include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last
    return sse(body)


def usage_chunk(header: Header, choices: list[Choice]) -> str:
    body = header.base("chat.completion.chunk" if header.kind == "chat" else "text_completion")
    body["choices"] = []
    body["usage"] = usage(choices)
    return sse(body)


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


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
    # Legacy completions: parallel lists; text offsets are known only when tokens carry their text.
    offsets, position = [], 0
    for lp in logprobs:
        offsets.append(position)
        position += 0 if lp.token.startswith("token_id:") else len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [dict(lp.top) for lp in logprobs],
        "text_offset": offsets,
    }

"""A Response object and its stream of events, built from the chat path's deltas of one choice.

The answer's text becomes output items as it streams: text goes into a `message` item (its one `output_text`
part), and, when the request has function tools, the tool-call parser (runtime/gateway/tool_parser.py) turns
`<tool_call>` blocks into `function_call` items, name first, then their arguments in pieces. Each item is
announced (`response.output_item.added`, a message's `response.content_part.added`), grows by deltas
(`response.output_text.delta`, `response.function_call_arguments.delta`) and is closed (`...done` events) when
the next item starts or the answer ends. The stream opens with `response.created` and `response.in_progress`
and ends with `response.completed` (or `response.incomplete` when max_output_tokens cut the answer, or
`response.failed` after an upstream error), each carrying the whole Response object; every event has the
next `sequence_number`. A response that is not streamed is built by the same steps, so the two are equal.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from runtime.gateway.errors import GatewayError
from runtime.gateway.responses import Choice
from runtime.gateway.tool_parser import CallDelta, ToolCallParser
from runtime.gateway.wire import Delta

_JSON = json.JSONEncoder(ensure_ascii=False)
OnDone = Callable[[dict[str, Any]], None]  # called with a finished Response object (to store it)


class ResponseRender:
    """One Response: `chunk` per delta (its events), then `end` (the closing events) or `failed`; `whole` for
    a response that is not streamed."""

    def __init__(
        self, model: str, settings: dict[str, Any], tool_names: frozenset[str] | None, on_done: OnDone
    ) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.model, self.settings, self.on_done = model, settings, on_done
        self.created_at = int(time.time())
        self.parser = ToolCallParser(tool_names) if tool_names is not None else None
        self.output: list[dict[str, Any]] = []
        self.open = False  # the last output item still grows
        self.finish_reason: str | None = None
        self.sequence_number = 0
        self.final: dict[str, Any] | None = None  # the finished Response object

    # ---- the renderer's interface (runtime/gateway/handler.py) ------------------------------------------

    def chunk(self, index: int, delta: Delta, first: bool) -> str:
        events = []
        if first:
            events += [
                self._event("response.created", response=self.body("in_progress")),
                self._event("response.in_progress", response=self.body("in_progress")),
            ]
        text, calls = self.parser.feed(delta.text) if self.parser is not None else (delta.text, [])
        if delta.finish_reason is not None and self.parser is not None:
            text += self.parser.finish()[0]
        if text:
            events += self._text(text)
        for call in calls:
            events += self._call(call)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return "".join(events)

    def end(self, choices: list[Choice]) -> str:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events = self._text("") if not self.output else []  # an empty answer is an empty message
        events += self._close(status)
        self.final = self.body(status, choices[0])
        self.on_done(self.final)
        return "".join(events) + self._event(f"response.{status}", response=self.final)

    def failed(self, exc: GatewayError) -> str:
        events = self._close("incomplete")
        body = self.body("failed")
        body["error"] = {"code": exc.code or exc.type, "message": exc.message}
        return "".join(events) + self._event("response.failed", response=body)

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        choice = choices[0]
        self.chunk(0, Delta(choice.text, choice.finish_reason, choice.prompt_tokens, choice.completion_tokens), True)
        self.end(choices)
        assert self.final is not None
        return self.final

    # ---- the Response object ---------------------------------------------------------------------------

    def body(self, status: str, choice: Choice | None = None) -> dict[str, Any]:
        cut = status == "incomplete"
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            **self.settings,
            "usage": None,
        }
        if choice is not None:
            prompt, completion = choice.prompt_tokens, choice.completion_tokens
            body["usage"] = {
                "input_tokens": prompt,
                "output_tokens": completion,
                "total_tokens": prompt + completion,
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return body

    # ---- output items ----------------------------------------------------------------------------------

    def _text(self, text: str) -> list[str]:
        events = []
        if not (self.open and self.output[-1]["type"] == "message"):
            events += self._close()
            item: dict[str, Any] = {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
            item["content"].append(part)
        if text:
            self.output[-1]["content"][0]["text"] += text
            events.append(
                self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
            )
        return events

    def _call(self, call: CallDelta) -> list[str]:
        events = []
        if call.name is not None:  # a new call
            events += self._close()
            events += self._add(
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": "",
                    "status": "in_progress",
                }
            )
        if call.arguments:
            self.output[-1]["arguments"] += call.arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=call.arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        self.open = True
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self, status: str = "completed") -> list[str]:
        """The last item's done events (none if it is closed already)."""
        if not self.open:
            return []
        self.open = False
        item = self.output[-1]
        item["status"] = status
        if item["type"] == "message":
            part, where = item["content"][0], {**self._where(), "content_index": 0}
            events = [
                self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
            ]
        else:
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **self._where(),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        return [*events, self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _event(self, kind: str, **fields: Any) -> str:
        data = _JSON.encode({"type": kind, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1
        return f"event: {kind}\ndata: {data}\n\n"

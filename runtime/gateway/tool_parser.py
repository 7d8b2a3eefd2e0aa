"""Tool calls read out of a choice's text as it streams (the format: engine_format/tool_calls.py).

`ToolCallParser.feed` takes each text delta and returns what to send on: content, and call deltas as OpenAI
streams them (a call's id and name first, then its arguments' JSON text piece by piece). A whole answer is
parsed by feeding it at once, so a streamed answer reassembles to exactly the unstreamed one: nothing the
parser decides depends on where deltas split the text. To that end it holds back what the next text could
change: a tail that may begin `<tool_call>`, whitespace that may turn out to stand between calls (dropped),
and a call's header until the first character of its arguments.

Arguments stream as the model writes them (the JSON text of the arguments value, exactly): they end at the
call object's closing brace. A block whose header is not `{"name": "<one of the tools>", "arguments": ...`
(a model writing freely, tool_choice auto) is read whole at its `</tool_call>`: a JSON object with a known
name and arguments becomes a call, anything else is passed on as text. A block cut off by the end of the
answer (max_tokens) keeps what it streamed: a call with incomplete arguments, or text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engine_format.tool_calls import CLOSE, OPEN

HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class CallDelta:
    index: int  # the call's, within its choice
    arguments: str  # JSON text to append to the call's arguments
    id: str | None = None  # with the name, on a call's first delta only
    name: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallParser:
    names: frozenset[str]
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""  # passed on so far
    _buffer: str = ""
    _mode: str = "text"  # text | header | arguments | after
    _depth: int = 0  # arguments: nesting inside the call object (1: the object itself)
    _in_string: bool = False
    _escaped: bool = False
    _held: str = ""  # arguments: trailing whitespace read but not sent (the arguments may end after it)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content and call deltas to send on for the next piece of the answer."""
        self._buffer += text
        out, deltas = "", []
        while True:
            step = {"text": self._text, "header": self._header, "arguments": self._arguments,
                    "after": self._after}[self._mode]  # fmt: skip
            emitted, delta, progressed = step()
            out += emitted
            deltas += delta
            if not progressed:
                break
        self.content += out
        return out, deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left to send once the answer ended."""
        out = ""
        if self._mode == "text":
            out = self._buffer.rstrip() if self._buffer.strip() else ""
        elif self._mode == "header":  # a block that never became a call: its text
            out = OPEN + self._buffer
        self._buffer = ""
        self.content += out
        return out, []

    def _text(self) -> tuple[str, list[CallDelta], bool]:
        start = self._buffer.find(OPEN)
        if start >= 0:
            before, self._buffer = self._buffer[:start], self._buffer[start + len(OPEN) :]
            self._mode = "header"
            return (before.rstrip() if before.strip() else ""), [], True
        keep = _partial_tag(self._buffer)
        ready = self._buffer[: len(self._buffer) - keep]
        sent = ready.rstrip()  # trailing whitespace waits: it may stand before a call
        self._buffer = ready[len(sent) :] + self._buffer[len(ready) :]
        return sent, [], False

    def _header(self) -> tuple[str, list[CallDelta], bool]:
        match = HEADER.match(self._buffer)
        if match is not None:
            name = _string(match.group(1))
            if name in self.names:
                call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name)
                self.calls.append(call)
                self._buffer = self._buffer[match.end() :]
                self._mode, self._depth, self._in_string, self._escaped, self._held = "arguments", 1, False, False, ""
                return "", [CallDelta(len(self.calls) - 1, "", call.id, name)], True
        end = self._buffer.find(CLOSE)
        if end < 0:
            return "", [], False
        block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
        self._mode = "text"
        whole = _whole_call(block, self.names)
        if whole is None:
            return OPEN + block + CLOSE, [], True
        call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", whole[0], whole[1])
        self.calls.append(call)
        return "", [CallDelta(len(self.calls) - 1, call.arguments, call.id, call.name)], True

    def _arguments(self) -> tuple[str, list[CallDelta], bool]:
        end = None
        for i, char in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i
                    break
            elif char == "," and self._depth == 1:  # another key after the arguments: they ended
                end = i
                break
        read = self._held + (self._buffer if end is None else self._buffer[:end])
        self._buffer = "" if end is None else self._buffer[end:]
        piece = read.rstrip()
        self._held = read[len(piece) :] if end is None else ""
        if end is not None:
            self._mode = "after"
        self.calls[-1].arguments += piece
        deltas = [CallDelta(len(self.calls) - 1, piece)] if piece else []
        return "", deltas, end is not None

    def _after(self) -> tuple[str, list[CallDelta], bool]:
        end = self._buffer.find(CLOSE)
        if end < 0:
            return "", [], False
        self._buffer, self._mode = self._buffer[end + len(CLOSE) :], "text"
        return "", [], True


def _partial_tag(text: str) -> int:
    """Length of the longest tail of `text` that begins OPEN (so may become it)."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def _string(escaped: str) -> str | None:
    try:
        return json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return None


def _whole_call(block: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block holding one call object, else None."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get("arguments"), dict):
        return None
    return value["name"], json.dumps(value["arguments"], ensure_ascii=False)


def parse_whole(text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's content (None: none but whitespace) and calls."""
    parser = ToolCallParser(names)
    parser.feed(text)
    parser.finish()
    return parser.content or None, parser.calls

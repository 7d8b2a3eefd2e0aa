"""Read timeouts for slow clients: a request's head must arrive within `header_s`, its body within `body_s`.

Why: uvicorn times out only idle keep-alive connections (between requests). A client that connects and
sends nothing, or sends its request head a byte a second (Slowloris), or a body likewise, holds its
connection, a parser and, for a body, the handler awaiting it for as long as it keeps dribbling: enough
such clients exhaust file descriptors and memory while sending almost nothing.

Why in the protocol, not the ASGI app: no app runs until a head is complete, so only the protocol sees a
head arrive; and a body can be dribbled to a route that never reads it (its response already sent, each
byte ignored by uvicorn yet keeping the connection busy), so an app-level body timeout would miss it.

How: a subclass of uvicorn's own protocol class (httptools', h11's when httptools is missing) looks after
every read at the phase the connection is in: waiting for a head (from the connection, or from the first
byte after a response), reading a body (from the end of its head), or neither (the app's turn, or an idle
keep-alive connection, which uvicorn's keep-alive timeout closes). Entering a phase arms its timer; it is
not re-armed by bytes within the phase, so dribbling cannot extend it. On expiry the connection closes,
after a 408 in OpenAI's error shape when no response has started.

Every close of the connection, ours or uvicorn's, lingers (runtime/gateway/lingering.py): a client still
sending reads the 408 or 413 instead of a reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from runtime.gateway.lingering import LingeringTransport

log = logging.getLogger(__name__)

HEAD = "head"  # the phase of a connection waiting for a complete request head (a body's phase is its cycle)


@dataclass(frozen=True)
class ReadTimeouts:
    header_s: float = 10.0  # from the connection (or the next request's first byte) to the end of its head
    body_s: float = 30.0  # from the end of the head to the end of the body (64 MiB at ~2 MB/s)

    def __post_init__(self) -> None:
        for name in ("header_s", "body_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def timeout_response(what: str) -> bytes:
    """The raw 408 a timed-out connection gets before it closes."""
    message = f"the request {what} did not arrive in time"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": "request_timeout"}
    body = json.dumps({"error": error}).encode()
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body))  # fmt: skip
    return head + body


class ReadDeadlines(asyncio.Protocol):
    """Mixin over a uvicorn HTTP protocol class (see `timed_protocol`): uses its `loop`, `transport` (which it
    makes a LingeringTransport) and `cycle` (the current RequestResponseCycle: `more_body`, `response_started`,
    `response_complete`)."""

    read_timeouts: ClassVar[ReadTimeouts]
    loop: asyncio.AbstractEventLoop
    transport: LingeringTransport
    cycle: Any
    _deadline: asyncio.TimerHandle | None = None
    _phase: object = None  # HEAD, the cycle whose body is awaited, or None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        lingering = LingeringTransport(cast(asyncio.Transport, transport), self.loop)  # uvloop's: not a subclass
        super().connection_made(cast(asyncio.Transport, lingering))  # duck-typed
        self._track()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return  # the rest of a request that was answered: drained and dropped
        super().data_received(data)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        self.transport.connection_lost()
        super().connection_lost(exc)

    def _track(self) -> None:
        cycle = self.cycle
        if self.transport.is_closing():
            self._enter(None)
        elif cycle is not None and cycle.more_body:
            self._enter(cycle)
        elif cycle is None or cycle.response_complete:
            self._enter(HEAD)
        else:
            self._enter(None)

    def _enter(self, phase: object) -> None:
        if phase is self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            limit = self.read_timeouts.header_s if phase is HEAD else self.read_timeouts.body_s
            self._deadline = self.loop.call_later(limit, self._expired)

    def _expired(self) -> None:
        what = "head" if self._phase is HEAD else "body"
        self._deadline, self._phase = None, None
        cycle = self.cycle
        respond = what == "head" or not cycle.response_started  # a body's request may have its answer already
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # as connection_lost would: the app's sends are dropped from now on
            cycle.message_event.set()  # and a receive() waiting for the body returns http.disconnect
        log.info("closing a connection from %s: the request %s did not arrive in time", self.transport
                 .get_extra_info("peername"), what)  # fmt: skip
        if respond:
            self.transport.write(timeout_response(what))
        self.transport.close()


def timed_protocol(timeouts: ReadTimeouts) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (as its `http="auto"` picks) with `timeouts`: pass as uvicorn's `http`."""
    base: type[asyncio.Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    return type(f"ReadDeadline{base.__name__}", (ReadDeadlines, base), {"read_timeouts": timeouts})

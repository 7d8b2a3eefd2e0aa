"""A lingering close, as nginx's `lingering_close`: the gateway's answer reaches a client that is still sending.

Why: the gateway closes connections whose request it will not read to the end: a read timeout (408), a
request uvicorn cannot parse (400), a keep-alive or shutdown close while a refused body (413) still arrives.
Closing a socket with unread bytes in its receive buffer makes the kernel send a reset instead of a FIN; a
client still writing its body then fails on its next send, and most HTTP clients (urllib, requests, httpx)
report "connection reset" and never read the answer that explains why.

How: `close()` writes what is buffered, then half-closes (FIN), reads and drops whatever the client still
sends, and closes for good when the client closes its side or after `linger_s`, whichever comes first. A
transport that cannot half-close (TLS) closes at once, as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

LINGER_S = 2.0  # bounded: a client that keeps sending is cut after this long, as before but later


class LingeringTransport:
    """The connection's transport as uvicorn's protocol sees it (everything else passes through). The protocol
    drops what `data_received` gets while `lingering`; `eof_received` returning nothing ends the linger."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, linger_s: float = LINGER_S):
        self._transport, self._loop, self._linger_s = transport, loop, linger_s
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        if not self._transport.can_write_eof():
            self._transport.close()
            return
        self.lingering = True
        if self._paused:  # uvicorn's flow control: reading must go on to drain the client
            self._transport.resume_reading()
        self._transport.write_eof()  # after the buffered answer
        self._timer = self._loop.call_later(self._linger_s, self._transport.close)

    def connection_lost(self) -> None:
        """The protocol saw the connection end: the linger timer has nothing left to close."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.lingering:  # the answer is out and the write side shut: later writes have nowhere to go
            self._transport.write(data)

    def pause_reading(self) -> None:
        if not self.lingering:
            self._paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if not self.lingering:
            self._paused = False
            self._transport.resume_reading()

    def abort(self) -> None:
        self.connection_lost()
        self._transport.abort()

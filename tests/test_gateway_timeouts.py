"""Slow clients against a real gateway process (`--header-timeout 0.5 --body-timeout 1.5`, no backend needed):
a connection that sends nothing, a request head or body dribbled a byte at a time, is answered 408 and closed,
whatever route it is for, and the gateway serves on.

The tests dribble until the gateway closes the connection (each byte waits for the socket to turn readable,
up to a pace), never for a fixed time; a head or body that ran out before the close fails the test.
"""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator

import pytest

from runtime.gateway.process import GatewayProcess
from runtime.serve.launcher import free_port
from tests.gateway_helpers import running_gateway

HEADER_TIMEOUT, BODY_TIMEOUT = "0.5", "1.5"
PACE_S = 0.05  # between dribbled bytes
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    timeouts = ("--header-timeout", HEADER_TIMEOUT, "--body-timeout", BODY_TIMEOUT)
    with running_gateway(free_port(), "nowhere", *timeouts, healthy=False) as gw:  # no backend listens there
        yield gw


def connect(gateway: GatewayProcess) -> socket.socket:
    sock = socket.create_connection((gateway.host, gateway.port), timeout=30)
    return sock


def dribble(sock: socket.socket, data: bytes) -> int:
    """Send `data` a byte at a time until the peer answers or closes; how many bytes went out."""
    for sent, byte in enumerate(data):
        readable, _, _ = select.select([sock], [], [], PACE_S)
        if readable:
            return sent
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return sent
    raise AssertionError(f"the gateway kept the connection through {len(data)} dribbled bytes")


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def timeout_answer(raw: bytes) -> dict:
    """The one 408 response in `raw`, and its error object."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), raw
    assert b"connection: close" in head.lower()
    assert raw.count(b"HTTP/1.1 ") == 1, raw
    return json.loads(body)["error"]


def still_serving(gateway: GatewayProcess) -> None:
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        assert read_to_close(sock).startswith(b"HTTP/1.1 503 ")  # answers: no backend is ready


def test_a_connection_that_sends_nothing_is_closed_with_408(gateway):
    with connect(gateway) as sock:
        error = timeout_answer(read_to_close(sock))
    assert error == {"message": "the request head did not arrive in time", "type": "invalid_request_error",
                     "param": None, "code": "request_timeout"}  # fmt: skip
    still_serving(gateway)


def test_a_head_dribbled_a_byte_at_a_time_is_cut(gateway):
    head = HEAD + b"X-Padding: " + b"a" * 2000  # never finished
    with connect(gateway) as sock:
        sent = dribble(sock, head)
        error = timeout_answer(read_to_close(sock))
    assert 0 < sent < len(head) and error["message"] == "the request head did not arrive in time"
    still_serving(gateway)


def test_a_body_dribbled_after_a_prompt_head_is_cut_by_the_body_timeout(gateway):
    """The head timer stops at the end of the head: the body gets its own, longer, limit (a head timer
    left running would cut this connection first, as a head timeout)."""
    body = b'{"model": "nowhere", "messages": [' + b" " * 2000
    with connect(gateway) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % (len(body) + 10))
        sent = dribble(sock, body)
        error = timeout_answer(read_to_close(sock))
    assert 0 < sent < len(body) and error["message"] == "the request body did not arrive in time"
    still_serving(gateway)


def test_the_next_request_on_a_kept_alive_connection_is_timed_from_its_first_byte(gateway):
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 503 ")
        sent = dribble(sock, b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Padding: " + b"a" * 2000)
        error = timeout_answer(read_to_close(sock))
    assert sent > 0 and error["message"] == "the request head did not arrive in time"


def test_a_body_dribbled_to_a_route_that_never_reads_it_is_cut_too(gateway):
    """/health answers at once and ignores the body; the dribbling client still loses the connection
    (without a second response: one has been sent)."""
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nContent-Length: 100000\r\n\r\n")
        readable, _, _ = select.select([sock], [], [], 30)
        assert readable
        answer = sock.recv(65536)  # the 503, before any body byte
        assert answer.startswith(b"HTTP/1.1 503 ")
        dribble(sock, b"x" * 2000)
        rest = read_to_close(sock)
    assert b"HTTP/1.1 " not in rest
    still_serving(gateway)

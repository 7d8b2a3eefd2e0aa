"""Slow clients against a real gateway process (`--header-timeout 2 --body-timeout 4`, no backend needed):
a connection that sends nothing, a request head or body dribbled a byte at a time, is answered 408 and closed,
whatever route it is for, and the gateway serves on; a client still sending when the gateway closes reads its
answer (the lingering close), and is cut after a bounded linger.

The tests dribble until the gateway closes the connection (each byte waits for the socket to turn readable,
up to a pace), never for a fixed time; a head or body that ran out before the close fails the test.

No margin is a race: what must beat a limit (a head sent on connecting, the first dribbled byte) is a step
or two of this process, stalled ~0.1 s at worst on a loaded machine (2 vCPUs, 6 busy loops), and the limits
are 2 s and 4 s (a 0.5 s head limit was within reach of a stall). A response on a kept-alive connection is
read whole, by its content-length: one recv() may return its head alone (uvicorn writes head and body
separately), and a dribble after it would stop at once on the body's bytes.
"""

from __future__ import annotations

import json
import re
import select
import socket
from collections.abc import Iterator

import pytest

from runtime.gateway.process import GatewayProcess
from runtime.serve.launcher import free_port
from tests.gateway_helpers import running_gateway

HEADER_TIMEOUT, BODY_TIMEOUT = "2", "4"  # body > head: a head timer left running would cut first
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
    """Everything the peer sends until it closes the connection (a reset too: the gateway's lingering close
    resets a client still sending after LINGER_S; what came before the reset is still read)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def read_response(sock: socket.socket) -> bytes:
    """One whole response on a kept-alive connection: its head, then the content-length's bytes of body."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += recv_more(sock)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
    assert length, head
    while len(body) < int(length.group(1)):
        body += recv_more(sock)
    assert len(body) == int(length.group(1)), raw  # nothing beyond it: one response
    return raw


def recv_more(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the gateway closed the connection in the middle of a response"
    return chunk


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
        assert read_response(sock).startswith(b"HTTP/1.1 503 ")
        sent = dribble(sock, b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Padding: " + b"a" * 2000)
        error = timeout_answer(read_to_close(sock))
    assert sent > 0 and error["message"] == "the request head did not arrive in time"


def test_a_body_dribbled_to_a_route_that_never_reads_it_is_cut_too(gateway):
    """/health answers at once and ignores the body; the dribbling client still loses the connection
    (without a second response: one has been sent)."""
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nContent-Length: 100000\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 503 ")  # before any body byte
        sent = dribble(sock, b"x" * 2000)
        rest = read_to_close(sock)
    assert sent > 0 and b"HTTP/1.1 " not in rest  # a byte after the answer: uvicorn's keep-alive timer is off
    still_serving(gateway)


MALFORMED = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 1x\r\n\r\n"  # uvicorn: 400, close


def test_a_client_still_sending_its_body_reads_the_answer_to_a_malformed_request(gateway):
    """uvicorn answers a request it cannot parse with a 400 and closes while the client still sends: a plain
    close would reset the connection (unread bytes in the socket) and the client's send fail with the answer
    never read; the lingering close drains what it sends, then ends with a FIN."""
    with connect(gateway) as sock:
        sock.sendall(MALFORMED + b" " * 16 * 2**20)  # far past the socket buffers, sent after the answer
        raw = b""
        while chunk := sock.recv(65536):  # to the FIN: a reset here raises
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 400 "), raw[:300]
    still_serving(gateway)


def test_the_linger_is_bounded_for_a_client_that_never_stops_sending(gateway):
    """After its answer the gateway drains a client for LINGER_S at most: one that keeps sending is cut."""
    with connect(gateway) as sock:
        sock.sendall(MALFORMED)
        answer, cut, eof = b"", False, False
        for _ in range(10_000):  # 64 KiB per 10 ms, 100 s at least: 50x the linger
            readable, _, _ = select.select([] if eof else [sock], [], [], PACE_S / 5)
            if readable:
                chunk = sock.recv(65536)
                answer, eof = answer + chunk, not chunk  # the gateway's FIN: it reads on, drops what comes
            try:
                sock.sendall(b" " * 2**16)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
    assert cut and answer.startswith(b"HTTP/1.1 400 ")
    still_serving(gateway)

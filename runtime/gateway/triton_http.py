"""Triton's KServe v2 HTTP routes through the gateway: the safe door for Triton's HTTP clients.

Why: Triton 2.51's own HTTP frontend dies from one 4-5 MB application/x-www-form-urlencoded POST and cannot
bound request bodies, so tritonserver's ports stay on loopback. Its HTTP clients (curl, tritonclient.http,
KServe tooling) reach it here instead, with the OpenAI routes' checks (runtime.gateway.body):

    GET  /v2/health/live, /v2/health/ready                  public, as /health (probes carry no keys)
    GET  /v2/models/{model}, /v2/models/{model}/config       API key
    POST /v2/models/{model}/infer, /generate, /generate_stream   API key, body checks, admission

A POST is checked in this order: API key (401), body size (413), content type (415: JSON only, which also
refuses the binary tensor extension), JSON (400), then it takes its tenant's slot in the admission queue
(429), and its `cache_salt` input becomes the tenant's (runtime.gateway.tenants: the client's own salt is
mixed into it, as on /v1), so no client reaches another tenant's cache. The body then goes to
tritonserver's HTTP port (--triton-http-url) as JSON; the answer (status, content type, body) comes back
as it arrives: generate_stream's events one by one. A client that leaves closes the upstream connection,
on which Triton cancels the request (the engine aborts it). Upstream failures are 503s with Retry-After.
The gateway's own errors here use KServe's shape, {"error": "<message>"}, which tritonclient reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal

import aiohttp
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from runtime.gateway.body import read_json
from runtime.gateway.errors import GatewayError
from runtime.gateway.fair_queue import QueueFull
from runtime.gateway.service import Gateway
from runtime.gateway.tenants import Tenant

log = logging.getLogger(__name__)

MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # no "/" and no "..": nothing but a model's path
Action = Literal["infer", "generate", "generate_stream"]
ACTIONS: tuple[Action, ...] = ("infer", "generate", "generate_stream")
PASSED_HEADERS = ("content-type", "inference-header-content-length")  # from Triton's answer to the client
CONNECT_TIMEOUT_S = 5.0


class TritonHTTP:
    """tritonserver's HTTP endpoint (e.g. http://127.0.0.1:8000): one aiohttp session, opened on first use."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def send(self, method: str, path: str, body: dict[str, Any] | None = None) -> aiohttp.ClientResponse:
        """The answer's head (its body is read by the caller); 503 if tritonserver cannot be reached."""
        if self._session is None:  # in the serving loop: aiohttp binds to it
            timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S)
            self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept-Encoding": "identity"}  # bytes pass through as they come: nothing to decode
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            return await self._session.request(method, self.url + path, data=data, headers=headers)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise GatewayError.unavailable(f"tritonserver's HTTP endpoint is unreachable: {exc!r}") from None

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class Relay(Response):
    """Triton's answer passed through as it arrives; the client leaving closes the upstream connection
    (Triton cancels the request). `done` runs last, whatever happens (it releases the admission slot)."""

    def __init__(self, upstream: aiohttp.ClientResponse, done: Callable[[], Awaitable[None]]) -> None:
        self.upstream, self.done = upstream, done
        self.status_code = upstream.status
        self.background = None
        self.raw_headers = [(name.encode(), upstream.headers[name].encode()) for name in PASSED_HEADERS
                            if name in upstream.headers]  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(self._close_on_disconnect(receive))
        complete = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.upstream.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                if watcher.done():  # the client left: nobody to tell
                    return
                log.warning("tritonserver's HTTP answer was cut: %r", exc)
                if self.upstream.content_type != "text/event-stream":
                    raise  # uvicorn closes the connection: the body is visibly incomplete
                error = json.dumps({"error": f"tritonserver's stream was cut: {exc!r}"})
                await send({"type": "http.response.body", "body": f"data: {error}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            complete = True
        finally:
            watcher.cancel()
            if complete:
                self.upstream.release()
            else:
                self.upstream.close()
            await self.done()

    async def _close_on_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.upstream.close()


def kserve_error(exc: GatewayError) -> JSONResponse:
    response = exc.response()  # for its headers (Retry-After)
    return JSONResponse({"error": exc.message}, status_code=exc.status,
                        headers={k: v for k, v in response.headers.items() if k.startswith("retry-after")})  # fmt: skip


def add_triton_routes(app: FastAPI, gateway: Gateway, triton: TritonHTTP) -> None:
    @app.get("/v2/health/{state}")
    async def health(state: str) -> Response:
        if state not in ("live", "ready"):
            return kserve_error(GatewayError(404, f"no route /v2/health/{state}", "invalid_request_error"))
        return await _forward(triton, "GET", f"/v2/health/{state}")

    @app.get("/v2/models/{model}")
    async def metadata(model: str, request: Request) -> Response:
        return await _guarded(gateway, request, model, lambda _tenant: _forward(triton, "GET", f"/v2/models/{model}"))

    @app.get("/v2/models/{model}/config")
    async def config(model: str, request: Request) -> Response:
        path = f"/v2/models/{model}/config"
        return await _guarded(gateway, request, model, lambda _tenant: _forward(triton, "GET", path))

    @app.post("/v2/models/{model}/{action}")
    async def inference(model: str, action: str, request: Request) -> Response:
        if action not in ACTIONS:
            return kserve_error(GatewayError(404, f"no route /v2/models/{model}/{action}", "invalid_request_error"))
        path = f"/v2/models/{model}/{action}"
        return await _guarded(gateway, request, model, lambda tenant: _infer(gateway, triton, request, tenant, path))


async def _guarded(gateway: Gateway, request: Request, model: str,
                   answer: Callable[[Tenant | None], Awaitable[Response]]) -> Response:  # fmt: skip
    """The answer, after the API key and the model name's checks; GatewayErrors in KServe's shape."""
    try:
        tenant = gateway.authorize(request)
        if not MODEL_NAME.fullmatch(model):
            raise GatewayError(400, f"{model!r} is not a model name", "invalid_request_error", "model")
        return await answer(tenant)
    except GatewayError as exc:
        return kserve_error(exc)


async def _forward(triton: TritonHTTP, method: str, path: str, body: dict[str, Any] | None = None,
                   done: Callable[[], Awaitable[None]] | None = None) -> Response:  # fmt: skip
    async def nothing() -> None:
        return None

    release = done or nothing
    try:
        upstream = await triton.send(method, path, body)
    except BaseException:
        await release()
        raise
    return Relay(upstream, release)


async def _infer(gateway: Gateway, triton: TritonHTTP, request: Request, tenant: Tenant | None, path: str) -> Response:
    if "inference-header-content-length" in request.headers:
        raise GatewayError(415, "binary tensor data is not accepted here: send the request as JSON",
                           "invalid_request_error", code="unsupported_media_type")  # fmt: skip
    body = await read_json(request)
    if path.endswith("/generate") and isinstance(body, dict) and body.get("stream") is True:
        # Triton's generate would answer 200 with an error in the body ("expects model to produce exactly 1
        # response"): a client checking the status would take it for an answer.
        raise GatewayError.invalid("'stream' true needs /generate_stream (/generate answers once)", "stream")
    salted(gateway, tenant, body, inputs=path.endswith("/infer"))
    slot = gateway.queue.slot(gateway.queue_key(request, tenant, None))
    try:
        await slot.__aenter__()
    except QueueFull as exc:
        raise GatewayError.overloaded(str(exc), exc.retry_after_s) from None
    return await _forward(triton, "POST", path, body, done=lambda: _leave(slot))


async def _leave(slot: AbstractAsyncContextManager[float]) -> None:
    with contextlib.suppress(Exception):
        await slot.__aexit__(None, None, None)


def salted(gateway: Gateway, tenant: Tenant | None, body: dict[str, Any], inputs: bool) -> None:
    """Set the request's `cache_salt` to its tenant's (mixed with the client's own, if it sent one): a top-level
    field of generate's JSON, or (`inputs`) a BYTES tensor among /infer's inputs."""
    if not inputs:
        client_salt = body.pop("cache_salt", None)
        if client_salt is not None and not isinstance(client_salt, str):
            raise GatewayError.invalid("'cache_salt' must be a string", "cache_salt")
        salt = gateway.cache_salt(tenant, client_salt)
        if salt is not None:
            body["cache_salt"] = salt
        return
    tensors = body.get("inputs")
    if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
        raise GatewayError.invalid("'inputs' must be a list of tensors", "inputs")
    given = [t for t in tensors if t.get("name") == "cache_salt"]
    client_salt = None
    if given:
        data = given[0].get("data")
        if len(given) > 1 or not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], str):
            raise GatewayError.invalid("the 'cache_salt' input must be one string", "cache_salt")
        client_salt = data[0]
    salt = gateway.cache_salt(tenant, client_salt)
    body["inputs"] = [t for t in tensors if t.get("name") != "cache_salt"]
    if salt is not None:
        body["inputs"].append({"name": "cache_salt", "datatype": "BYTES", "shape": [1], "data": [salt]})

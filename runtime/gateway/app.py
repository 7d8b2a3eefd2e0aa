"""The gateway's ASGI app: OpenAI's /v1 endpoints over tritonserver, plus /health, /metrics and /admin.

/health and /metrics are public (probes and Prometheus carry no keys); /metrics holds no per-tenant series
(runtime.gateway.tenants): those are at /admin/metrics. With a Triton HTTP URL, Triton's KServe v2 routes
too (runtime.gateway.triton_http).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from runtime.gateway.admin import add_admin_routes
from runtime.gateway.errors import GatewayError
from runtime.gateway.handler import ENDPOINTS, Endpoint, generate
from runtime.gateway.loras import add_lora_routes
from runtime.gateway.responses_api.routes import add_responses_routes
from runtime.gateway.service import Gateway
from runtime.gateway.tokenize import add_tokenizer_routes
from runtime.gateway.triton_http import TritonHTTP, add_triton_routes

log = logging.getLogger(__name__)
GENERATION_PATHS: dict[str, Endpoint] = {path: kind for kind, path in ENDPOINTS.items()}


class GenerationFastPath:
    """ASGI: POSTs to the generation endpoints go straight to the handler; everything else (the lifespan
    too) to the FastAPI app. Why: FastAPI's middleware, routing and dependency solving per request, and its
    middleware's send wrappers per streamed token, cost CPU that the engine shares, and the handler uses none
    of them: it reads its own body and answers its own errors. A crash before the answer starts is a 500 in
    OpenAI's shape here (FastAPI's would be plain text); the app keeps routes for the same paths, e.g. for
    its 405s and redirects."""

    def __init__(self, app: FastAPI, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = GENERATION_PATHS.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await generate(self.gateway, Request(scope, receive, send), kind)
        except Exception:
            log.exception("a generation request failed")
            response = GatewayError(500, "the gateway failed to answer", "server_error").response()
        await response(scope, receive, send)


def create_app(gateway: Gateway) -> GenerationFastPath:
    triton = TritonHTTP(gateway.settings.triton_http_url) if gateway.settings.triton_http_url else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()
            if triton is not None:
                await triton.close()

    app = FastAPI(title="trtserve OpenAI gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)  # unknown paths, wrong methods: OpenAI's error shape too
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return GatewayError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return GatewayError.invalid(str(exc.errors()[0].get("msg", exc))).response()

    add_admin_routes(app, gateway)
    add_lora_routes(app, gateway.loras, lambda http: gateway.authorize(http, admin=True))
    add_tokenizer_routes(app, gateway)
    if triton is not None:
        add_triton_routes(app, gateway, triton)

    @app.get("/health")
    async def health() -> Response:
        healthy = [name for name, pool in gateway.pools.items() if pool.healthy]
        body = {"status": "ok" if healthy else "no healthy backend", "healthy_backends": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        gateway.authorize(request)
        await gateway.loras.refresh()
        return {"object": "list", "data": _model_cards(gateway)}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        gateway.authorize(request)
        await gateway.resolve(model)  # 404 unless served
        return next(card for card in _model_cards(gateway) if card["id"] == model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(gateway, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(gateway, request, "text")

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await generate(gateway, request, "responses")

    add_responses_routes(app, gateway)

    return GenerationFastPath(app, gateway)


def _model_cards(gateway: Gateway) -> list[dict[str, Any]]:
    """The models a client may name: the gateway's own (their `parent` null, as vLLM's base model), then the
    LoRA adapters of its backends."""
    created = int(gateway.started)
    own = [
        {"id": m, "object": "model", "created": created, "owned_by": "trtserve", "root": m, "parent": None}
        for m in gateway.model_ids
    ]
    return own + gateway.loras.cards(created)

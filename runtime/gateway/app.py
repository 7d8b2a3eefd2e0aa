"""The gateway's ASGI app: OpenAI's /v1 endpoints over tritonserver, plus /health, /metrics and /admin."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from runtime.gateway.admin import add_admin_routes
from runtime.gateway.errors import GatewayError
from runtime.gateway.handler import generate, unknown_model
from runtime.gateway.service import Gateway


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

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
        return {"object": "list", "data": [_model_card(m, gateway.started) for m in gateway.model_ids]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        gateway.authorize(request)
        if model not in gateway.model_ids:
            raise unknown_model(model, gateway.model_ids)
        return _model_card(model, gateway.started)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(gateway, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(gateway, request, "text")

    return app


def _model_card(model: str, created: float) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": int(created), "owned_by": "trtserve"}

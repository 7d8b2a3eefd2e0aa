"""`GET` and `DELETE /v1/responses/{id}`: a kept response, read or dropped by its owner (the store's rules).
`POST /v1/responses` is a generation endpoint: runtime/gateway/handler.py."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runtime.gateway.responses_api.store import owner_of
from runtime.gateway.service import Gateway


def add_responses_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, http: Request) -> Response:
        owner = owner_of(gateway.authorize(http))
        return JSONResponse(gateway.responses.get(owner, response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, http: Request) -> Response:
        owner = owner_of(gateway.authorize(http))
        gateway.responses.delete(owner, response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

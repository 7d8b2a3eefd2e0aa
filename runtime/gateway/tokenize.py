"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by the model's own tokenizer (the request contract's
`tokenize` field: runtime/triton_model/tokenize.py), so that a client counts exactly the tokens the engine will.

    {"model", "prompt"} or {"model", "messages"} (the chat template, with its generation prompt)
        -> {"count": N, "max_model_len": M, "tokens": [...]}
    {"model", "tokens"} -> {"prompt": "..."}

Same door as the generation routes: API key, body checks, model (404), health, the tenant's admission slot; a
virtual model's tokenizer is its first backend's (every backend of one virtual model serves one tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated

from fastapi import FastAPI
from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runtime.gateway.body import read_model
from runtime.gateway.errors import GatewayError
from runtime.gateway.exchange import Exchange
from runtime.gateway.protocol import LIMITS, ChatMessage, PromptText, TokenIds
from runtime.gateway.service import Gateway
from runtime.gateway.strict import Strict
from runtime.gateway.tenants import Tenant
from runtime.gateway.wire import GenerateRequest


class TokenizeRequest(Strict):
    model: str
    prompt: PromptText | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=LIMITS.max_messages)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise GatewayError.invalid("give exactly one of 'prompt' (text) or 'messages' (chat)", "prompt")
        return self

    def upstream(self) -> GenerateRequest:
        messages = None if self.messages is None else [m.as_upstream() for m in self.messages]
        return GenerateRequest(self.prompt, messages, {}, tokenize="encode")


class DetokenizeRequest(Strict):
    model: str
    tokens: TokenIds

    def upstream(self) -> GenerateRequest:
        return GenerateRequest(self.tokens, None, {}, tokenize="decode")


async def tokenizer_call(gateway: Gateway, http: Request, tenant: Tenant | None, model: str,
                         request: GenerateRequest) -> str:  # fmt: skip
    """The model's answer (text_output) to a tokenizer request, through one replica of `model`'s backend."""
    routed, _ = await gateway.resolve(model)  # an adapter's tokenizer is its base model's
    decision = replace(gateway.router.route(routed, 0, False), escalate_to=None)
    await gateway.check_health(decision)
    exchange = Exchange(decision, gateway.pools, gateway.router, [request], stream=False, want_logprobs=False)
    try:
        await gateway.admit(exchange, http, tenant, None)
        return "".join([event.delta.text async for event in exchange.events()])
    finally:
        await exchange.close()


def add_tokenizer_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/tokenize")
    async def tokenize(http: Request) -> Response:
        tenant = gateway.authorize(http)
        body = await read_model(http, TokenizeRequest)
        answer = json.loads(await tokenizer_call(gateway, http, tenant, body.model, body.upstream()))
        tokens = answer["tokens"]
        return JSONResponse({"count": len(tokens), "max_model_len": answer["max_model_len"], "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(http: Request) -> Response:
        tenant = gateway.authorize(http)
        body = await read_model(http, DetokenizeRequest)
        try:
            text = await tokenizer_call(gateway, http, tenant, body.model, body.upstream())
        except GatewayError as exc:
            if exc.param == "prompt":  # the model's word for the ids this route calls `tokens`
                exc.param = "tokens"
            raise
        return JSONResponse({"prompt": text})

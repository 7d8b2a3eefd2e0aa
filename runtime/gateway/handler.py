"""One generation request, end to end: checks, admission, upstream, the answer (whole or streamed).

Order of checks: API key (401: the tenant, runtime.gateway.tenants), body (runtime.gateway.body: 413 size, 415
content type, 400), model (404), backend health (503, unless it has served before: then the request waits
for a replica to come back, runtime.gateway.exchange), admission queue (429, the tenant's limits), then
upstream, whose errors keep their meaning (400 invalid, 429 overloaded, 503 unreachable or restarting).
A stream commits to 200 only once every choice has produced its first delta, so failures before that
still get their status. A disconnect watcher closes the exchange (cancelling the upstream requests) as
soon as the client leaves, whatever the handler is waiting on then; the stream's own cleanup covers
Starlette cancelling it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.gateway import responses
from runtime.gateway.body import read_model
from runtime.gateway.errors import GatewayError
from runtime.gateway.exchange import Event, Exchange
from runtime.gateway.protocol import ChatCompletionRequest, CompletionRequest, Generation
from runtime.gateway.responses import Choice, CompletionRender, Header, Kind
from runtime.gateway.responses_api.protocol import ResponsesRequest, output_messages
from runtime.gateway.responses_api.render import ResponseRender
from runtime.gateway.responses_api.store import owner_of
from runtime.gateway.service import Gateway
from runtime.gateway.tenants import Tenant
from runtime.gateway.tokenize import tokenizer_call
from runtime.gateway.wire import Delta, GenerateRequest

Endpoint = Literal["chat", "text", "responses"]
ENDPOINTS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "text": "/v1/completions",
    "responses": "/v1/responses",
}
DONE = responses.DONE.encode()


class Renderer(Protocol):
    """How an endpoint answers: whole, or as server-sent events (a chunk per delta, then the end, or an
    error once the stream's 200 went out)."""

    def whole(self, choices: list[Choice]) -> dict[str, Any]: ...
    def chunk(self, index: int, delta: Delta, first: bool) -> str: ...
    def end(self, choices: list[Choice]) -> str: ...
    def failed(self, exc: GatewayError) -> str: ...


RenderFor = Callable[[str], Renderer]  # the answering model's name (known once it answered) -> the renderer


class EventStream(StreamingResponse):
    """A StreamingResponse without its disconnect listener (an anyio task group and task per request: the
    handler's own watcher ends the stream when the client leaves, the exchange closes, the stream sees 499),
    whose last event, `data: [DONE]`, goes out with the body's end in one write. Clients that stop reading
    at [DONE] (aiohttp's SSE loops, the benchmarks' client) then find the response complete and keep the
    connection; sent apart, the end often arrives after they let go, and they reconnect for every request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream_response(send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        held = b""  # [DONE], until the stream ends (its generator still cleans up after yielding it)
        async for chunk in self.body_iterator:
            if held:
                await send({"type": "http.response.body", "body": held, "more_body": True})
                held = b""
            data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
            if data.endswith(DONE):
                held = data
            else:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": held, "more_body": False})


async def generate(gateway: Gateway, http: Request, endpoint: Endpoint) -> Response:
    call = Call(gateway, http, endpoint)
    model = "-"  # the label for requests naming no served model (client strings would grow the label set)
    try:
        tenant = gateway.authorize(http)
        render: RenderFor | None = None
        if endpoint == "responses":
            turn = await read_model(http, ResponsesRequest)
            model = turn.model if gateway.serves(turn.model) else model
            body: Generation
            body, render = _responses(gateway, turn, owner_of(tenant))
        else:
            body = await read_model(http, ChatCompletionRequest if endpoint == "chat" else CompletionRequest)
            model = body.model if gateway.serves(body.model) else model
        response = await call.run(body, tenant, render)
    except GatewayError as exc:
        gateway.metrics.requests.labels(call.endpoint, model, str(exc.status)).inc()
        return exc.response()
    gateway.metrics.requests.labels(call.endpoint, model, "200").inc()
    return response


def _responses(gateway: Gateway, turn: ResponsesRequest, owner: str) -> tuple[ChatCompletionRequest, RenderFor]:
    """The chat request a Responses turn means (after its previous response's conversation), and its renderer,
    which keeps the finished response for the next turn unless the request says not to."""
    history = []
    if turn.previous_response_id is not None:
        history = gateway.responses.get(owner, turn.previous_response_id, "previous_response_id").conversation
    body = turn.chat_request(history)

    def keep(response: dict[str, Any]) -> None:
        if turn.store:
            gateway.responses.put(owner, response, history + turn.turn + output_messages(response["output"]))

    return body, lambda model: ResponseRender(model, turn.echo(), body.tool_names, keep)


@dataclass
class Call:
    gateway: Gateway
    http: Request
    kind: Endpoint
    arrived: float = field(default_factory=time.monotonic)

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.kind]

    async def run(self, body: Generation, tenant: Tenant | None, render: RenderFor | None = None) -> Response:
        gateway = self.gateway
        routed, lora = await gateway.resolve(body.model)
        decision = gateway.router.route(routed, body.prompt_chars, body.stream)
        await gateway.check_health(decision)
        echo = await self._echo_texts(body, tenant)  # (before the generation holds the tenant's slot)
        if render is None:
            render = self._completion_render(body, echo)
        requests = body.upstream_requests(gateway.cache_salt(tenant, body.cache_salt))
        if lora is not None:
            requests = [replace(r, lora=lora) for r in requests]
        exchange = Exchange(decision, gateway.pools, gateway.router, requests, body.stream,
                            body.logprobs_n is not None, self._client_left, gateway.disagg)  # fmt: skip
        watcher = asyncio.create_task(self._close_on_disconnect(exchange))
        committed = False
        try:
            await gateway.admit(exchange, self.http, tenant, body.user)
            choices = [Choice(i, i // body.n) for i in range(len(exchange.requests))]  # n per prompt, in order
            if body.stream:
                first = await _first_events(exchange, len(choices))
                stream = self._stream(exchange, watcher, render(lora or exchange.model), choices, first)
                committed = True
                return EventStream(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            async for event in exchange.events():
                choices[event.index].add(event.delta)
            self._finished(exchange, choices)
            return JSONResponse(render(lora or exchange.model).whole(choices))
        except GatewayError as exc:
            if exc.status == 429 and exc.retry_after_s is None:  # the engine's own queue is full
                exc.retry_after_s = gateway.queue.retry_after_s
            raise
        finally:
            if not committed:  # once the stream exists, its generator owns the cleanup
                watcher.cancel()
                await exchange.close()

    def _client_left(self) -> None:
        self.gateway.metrics.cancelled.labels(self.endpoint).inc()

    async def _echo_texts(self, body: Generation, tenant: Tenant | None) -> tuple[str, ...] | None:
        """The prompts `echo` repeats, as text: token-id prompts decoded by the model's tokenizer."""
        if body.echoed is None:
            return None
        texts = []
        for prompt in body.echoed:
            if isinstance(prompt, list):
                decode = GenerateRequest(prompt, None, {}, tokenize="decode")
                prompt = await tokenizer_call(self.gateway, self.http, tenant, body.model, decode)
            texts.append(prompt)
        return tuple(texts)

    def _completion_render(self, body: Generation, echo: tuple[str, ...] | None) -> RenderFor:
        kind: Kind = "chat" if self.kind == "chat" else "text"
        want_logprobs, prompt_logprobs = body.logprobs_n is not None, body.prompt_logprobs is not None
        return lambda model: CompletionRender(
            Header(kind, model, want_logprobs, body.tool_names, echo=echo, prompt_logprobs=prompt_logprobs),
            body.include_usage,
            body.scores_only,
        )

    def _finished(self, exchange: Exchange, choices: list[Choice]) -> None:
        self.gateway.account(exchange, choices)
        self.gateway.metrics.latency.labels(self.endpoint).observe(time.monotonic() - self.arrived)

    async def _stream(self, exchange: Exchange, watcher: asyncio.Task[None], form: Renderer, choices: list[Choice],
                      first: list[Event]) -> AsyncIterator[str]:  # fmt: skip
        self.gateway.metrics.ttft.labels(self.endpoint).observe(time.monotonic() - self.arrived)
        started: set[int] = set()  # choices whose first chunk (chat: with the role) went out
        client_left = True  # unless the stream ends on its own
        try:
            pending = first  # then one event at a time: a plain loop, no generator layers per token
            while pending or not exchange.finished:
                event = pending.pop(0) if pending else await exchange.next()
                choices[event.index].add(event.delta)
                chunk = form.chunk(event.index, event.delta, event.index not in started)
                started.add(event.index)
                if chunk:  # empty: a tool-call parser holds this delta's text back (responses.CompletionRender)
                    yield chunk
            client_left = False
            yield form.end(choices)
            self._finished(exchange, choices)
        except GatewayError as exc:
            client_left = exc.status == 499  # else an upstream failure, told to the client
            if not client_left:
                yield form.failed(exc)
        finally:  # also reached when Starlette cancels the stream because the client left
            watcher.cancel()
            await exchange.close(client_left)

    async def _close_on_disconnect(self, exchange: Exchange) -> None:
        while (await self.http.receive())["type"] != "http.disconnect":
            pass
        await exchange.close(client_left=True)


async def _first_events(exchange: Exchange, count: int) -> list[Event]:
    """Events up to the first of each choice."""
    seen: set[int] = set()
    events = []
    while len(seen) < count:
        event = await exchange.next()
        seen.add(event.index)
        events.append(event)
    return events

"""One tritonserver over gRPC streaming (tritonclient.grpc.aio): requests in, deltas out.

Each generation gets its own bidirectional stream carrying one request: cancelling that call
(the client went away) cancels exactly that request upstream, where the model's
`is_cancelled()` poll aborts it and frees its KV blocks. The request side half-closes after
the request; Triton ends the stream after the final response.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from runtime.gateway.errors import GatewayError
from runtime.serve.request_inputs import INPUT

log = logging.getLogger(__name__)

# Triton input -> the OpenAI parameter a client knows it by, for errors the engine reports.
CLIENT_PARAM = {"text_input": "prompt", "messages": "messages", "logprobs": "logprobs"}
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class GenerateRequest:
    """One upstream generation: exactly one of `prompt` (raw text) or `messages` (chat)."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    params: Mapping[str, int | float | bool]  # scalar inputs of runtime.serve.request_inputs.INPUTS
    stop: tuple[str, ...] = ()
    request_id: str = ""
    cache_salt: str | None = None  # the tenant's (service.Gateway.cache_salt)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the model's "token" text when it sends one, else "token_id:<id>"
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class Delta:
    """Text since the previous delta; finish_reason is set on the last one only."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


def token_name(token_id: int, text: str | None = None) -> str:
    return text if text is not None else f"token_id:{token_id}"


def parse_logprobs(raw: bytes) -> list[TokenLogprob]:
    out = []
    for entry in json.loads(raw or b"[]"):
        # top entries: [token_id, logprob, text] (models before token text sent [token_id, logprob])
        top = [(token_name(int(t[0]), t[2] if len(t) > 2 else None), float(t[1])) for t in entry.get("top", [])]
        out.append(TokenLogprob(entry["token_id"], token_name(entry["token_id"], entry.get("token")),
                                float(entry["logprob"]), top))  # fmt: skip
    return out


def build_inputs(request: GenerateRequest, stream: bool) -> list[grpcclient.InferInput]:
    """The model's input tensors, typed by its one input table (runtime.serve.request_inputs.INPUTS)."""
    values: dict[str, list] = {**{name: [value] for name, value in request.params.items()}, "stream": [stream]}
    if request.messages is not None:
        values["messages"] = [json.dumps(request.messages).encode()]
    else:
        values["text_input"] = [(request.prompt or "").encode()]
    if request.stop:
        values["stop"] = [s.encode() for s in request.stop]
    if request.cache_salt is not None:
        values["cache_salt"] = [request.cache_salt.encode()]
    inputs = []
    for name, value in values.items():
        spec = INPUT[name]
        tensor = grpcclient.InferInput(name, [len(value)], spec.datatype)
        tensor.set_data_from_numpy(np.array(value, dtype=spec.dtype))
        inputs.append(tensor)
    return inputs


def classify(message: str, backend: str) -> GatewayError:
    """The model's error message -> the client's error (the gRPC stream carries no status code)."""
    if message.startswith("overloaded"):  # runtime.engine Overloaded: the engine's waiting queue is full
        return GatewayError.overloaded(f"backend {backend!r} is overloaded: {message}")
    if message.startswith(("engine error", "internal error")):
        return GatewayError(500, f"backend {backend!r} failed: {message}", "server_error", code="upstream_error")
    if "unknown model" in message or "is not ready" in message:  # Triton's own, before the model ran
        return GatewayError.unavailable(f"backend {backend!r} is not serving its model: {message}")
    field_name, sep, _ = message.partition(":")  # runtime.engine InvalidRequest: "<field>: <problem>"
    param = CLIENT_PARAM.get(field_name, field_name) if sep and field_name.isidentifier() else None
    return GatewayError.invalid(message, param)


class Upstream:
    """A tritonserver's gRPC endpoint serving `model`; `healthy` is kept by `probe()` and by failed calls."""

    def __init__(self, name: str, url: str, model: str) -> None:
        self.name, self.url, self.model = name, url, model
        self.healthy = False
        self._client: grpcaio.InferenceServerClient | None = None

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        if self._client is None:  # created lazily: grpc.aio binds to the running event loop
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def probe(self) -> bool:
        try:
            self.healthy = bool(await self.client.is_model_ready(self.model, client_timeout=PROBE_TIMEOUT_S))
        except (InferenceServerException, grpc.RpcError, OSError):
            self.healthy = False
        return self.healthy

    async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        """Deltas of one generation; raises GatewayError. Closing or cancelling the iterator
        before the last delta cancels the upstream request."""

        async def one_request() -> AsyncIterator[dict]:
            yield {"model_name": self.model, "inputs": build_inputs(request, stream), "request_id": request.request_id}

        call = self.client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    failure = classify(str(error), self.name)
                    if failure.status == 503:  # Triton answers but its model is not ready: out until a probe
                        self.healthy = False
                    raise failure
                delta = Delta(
                    text=result.as_numpy("text_output")[0].decode("utf-8", errors="replace"),
                    finish_reason=result.as_numpy("finish_reason")[0].decode() or None,
                    prompt_tokens=int(result.as_numpy("prompt_tokens")[0]),
                    completion_tokens=int(result.as_numpy("completion_tokens")[0]),
                    logprobs=parse_logprobs(result.as_numpy("logprobs")[0]),
                )
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
            raise GatewayError(502, f"backend {self.name!r} closed the stream early", "server_error")
        except (grpc.RpcError, InferenceServerException) as exc:
            self.healthy = False
            raise GatewayError.unavailable(f"backend {self.name!r} is unreachable: {_rpc_message(exc)}") from None
        finally:
            if not finished:
                call.cancel()  # the client left (or we failed): Triton cancels the request

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await client.close()
            except (asyncio.CancelledError, grpc.RpcError):  # closing during shutdown
                log.debug("closing the gRPC channel to %s failed", self.url)


def _rpc_message(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    return str(details() if callable(details) else exc)

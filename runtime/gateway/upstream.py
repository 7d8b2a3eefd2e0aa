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

log = logging.getLogger(__name__)

# Triton input name -> (tensor datatype, numpy dtype); names and types as in model_repository/llm/config.pbtxt.
SCALAR_INPUTS: dict[str, tuple[str, type]] = {
    "max_tokens": ("INT32", np.int32),
    "stream": ("BOOL", np.bool_),
    "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "top_p": ("FP32", np.float32),
    "min_p": ("FP32", np.float32),
    "repetition_penalty": ("FP32", np.float32),
    "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32),
    "seed": ("INT64", np.int64),
    "priority": ("INT32", np.int32),
    "logprobs": ("INT32", np.int32),
    "ignore_eos": ("BOOL", np.bool_),
}
# Triton input -> the OpenAI parameter a client knows it by, for errors the engine reports.
CLIENT_PARAM = {"text_input": "prompt", "messages": "messages", "logprobs": "logprobs"}
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class GenerateRequest:
    """One upstream generation: exactly one of `prompt` (raw text) or `messages` (chat)."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    params: Mapping[str, int | float | bool]  # keys of SCALAR_INPUTS
    stop: tuple[str, ...] = ()
    request_id: str = ""


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
        # top entries: [token_id, logprob] (or [token_id, logprob, text] once the model sends text)
        top = [(token_name(int(t[0]), t[2] if len(t) > 2 else None), float(t[1])) for t in entry.get("top", [])]
        out.append(TokenLogprob(entry["token_id"], token_name(entry["token_id"], entry.get("token")),
                                float(entry["logprob"]), top))  # fmt: skip
    return out


def build_inputs(request: GenerateRequest, stream: bool) -> list[grpcclient.InferInput]:
    tensors: list[tuple[str, np.ndarray, str]] = []
    if request.messages is not None:
        tensors.append(("messages", np.array([json.dumps(request.messages).encode()], dtype=np.object_), "BYTES"))
    else:
        tensors.append(("text_input", np.array([(request.prompt or "").encode()], dtype=np.object_), "BYTES"))
    for name, value in {**request.params, "stream": stream}.items():
        datatype, dtype = SCALAR_INPUTS[name]
        tensors.append((name, np.array([value], dtype=dtype), datatype))
    if request.stop:
        tensors.append(("stop", np.array([s.encode() for s in request.stop], dtype=np.object_), "BYTES"))
    inputs = []
    for name, array, datatype in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
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

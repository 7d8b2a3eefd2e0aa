"""One tritonserver over gRPC streaming (KServe's ModelStreamInfer): requests in, deltas out.

Each generation gets its own bidirectional stream carrying one request: cancelling that call
(the client went away) cancels exactly that request upstream, where the model's
`is_cancelled()` poll aborts it and frees its KV blocks. The request side half-closes after
the request; Triton ends the stream after the final response. The stub is tritonclient's generated
one on a grpc.aio channel; messages are built and read by runtime.gateway.wire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from runtime.gateway.errors import GatewayError
from runtime.gateway.wire import Delta, GenerateRequest, build_request, parse_response

log = logging.getLogger(__name__)

# Triton input -> the OpenAI parameter a client knows it by, for errors the engine reports.
CLIENT_PARAM = {"text_input": "prompt", "messages": "messages", "logprobs": "logprobs"}
PROBE_TIMEOUT_S = 2.0
MAX_MESSAGE_BYTES = 2**31 - 1  # as tritonclient's channels: a prompt may be large
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]  # fmt: skip


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
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    @property
    def stub(self) -> Any:
        """The GRPCInferenceService stub (created lazily: grpc.aio binds to the running event loop)."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.url, options=CHANNEL_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def probe(self) -> bool:
        try:
            answer = await self.stub.ModelReady(pb.ModelReadyRequest(name=self.model), timeout=PROBE_TIMEOUT_S)
            self.healthy = bool(answer.ready)
        except (grpc.RpcError, OSError):
            self.healthy = False
        return self.healthy

    async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        """Deltas of one generation; raises GatewayError. Closing or cancelling the iterator
        before the last delta cancels the upstream request."""
        call = self.stub.ModelStreamInfer()
        finished = False
        try:
            await call.write(build_request(self.model, request, stream))
            await call.done_writing()
            while (response := await call.read()) is not grpc.aio.EOF:
                if response.error_message:
                    finished = True
                    failure = classify(response.error_message, self.name)
                    if failure.status == 503:  # Triton answers but its model is not ready: out until a probe
                        self.healthy = False
                    raise failure
                try:
                    delta = parse_response(response.infer_response)
                except (KeyError, IndexError, ValueError) as exc:
                    raise GatewayError(502, f"backend {self.name!r} sent a malformed response: {exc!r}",
                                       "server_error") from None  # fmt: skip
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
            raise GatewayError(502, f"backend {self.name!r} closed the stream early", "server_error")
        except grpc.RpcError as exc:
            self.healthy = False
            raise GatewayError.unavailable(f"backend {self.name!r} is unreachable: {_rpc_message(exc)}") from None
        finally:
            if not finished:
                call.cancel()  # the client left (or we failed): Triton cancels the request

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            try:
                await channel.close()
            except (asyncio.CancelledError, grpc.RpcError):  # closing during shutdown
                log.debug("closing the gRPC channel to %s failed", self.url)


def _rpc_message(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    return str(details() if callable(details) else exc)

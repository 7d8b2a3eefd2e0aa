"""One tritonserver over gRPC streaming (KServe's ModelStreamInfer): requests in, deltas out.

Each generation gets its own bidirectional stream carrying one request: cancelling that call
(the client went away) cancels exactly that request upstream, where the model's
`is_cancelled()` poll aborts it and frees its KV blocks. The request side half-closes after
the request; Triton ends the stream after the final response. The stub is tritonclient's generated
one on a grpc.aio channel; messages are built and read by runtime.gateway.wire.

A replica whose model process (the Python backend's stub) died is not seen by Triton's readiness: it
keeps answering "ready", fails each new request with "Stub process '<instance>' is not healthy." (after
about a second) and keeps the streams of the requests that were running open, forever, until
tritonserver itself is stopped (`trtserve serve`'s supervisor restarts it once its probe sees the dead
stub, within a few seconds). So `probe()` asks the model too (the health request of engine_format/serving.py,
answered by the model's loop without the engine's queue), and the first sign of a dead stub, from a probe or from any
request's answer, fails every request open on that replica at once (their gRPC calls are cancelled; the
exchange retries those that produced nothing, the others end with an error event) and marks it
unhealthy until probes find it serving again. A slow probe is no such sign: it proves nothing, and a
false one would cut healthy streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from engine_format.kv_handle import KV_TRANSFER_FAILED
from engine_format.serving import DRAINING, ENGINE_STOPPED, HEALTH_PARAMETER
from runtime.gateway.errors import GatewayError
from runtime.gateway.wire import Delta, GenerateRequest, build_request, parse_response

log = logging.getLogger(__name__)

# Triton input -> the OpenAI parameter a client knows it by, for errors the engine reports.
CLIENT_PARAM = {"text_input": "prompt", "input_ids": "prompt", "messages": "messages", "logprobs": "logprobs"}
PROBE_TIMEOUT_S = 2.0
MODEL_PROBE_TIMEOUT_S = 5.0  # a dead stub answers in ~1 s (Triton's own wait for it); slower proves nothing
MAX_MESSAGE_BYTES = 2**31 - 1  # as tritonclient's channels: a prompt may be large
# gRPC retries a lost connection with a backoff that grows to 120 s by default: a replica restarted on its
# address would stay out of routing that long, its probes failing fast without trying. Capped at 1 s, a
# replica is back within a second and a probe interval of being ready.
RECONNECT_BACKOFF_MS = 1000
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)]  # fmt: skip


# In an error message, Triton's or the model's words for "this replica cannot serve now" (503: retried on
# another replica, or once it is back): no such model (yet), draining (engine_format/serving.py), the model's
# process or engine loop gone. The last two also mean the requests open there will never finish.
STUB_DEAD = "is not healthy"  # Triton's words for a Python-backend model whose stub process died
UNAVAILABLE = ("unknown model", "is not ready", STUB_DEAD, ENGINE_STOPPED)
DEAD = (STUB_DEAD, ENGINE_STOPPED)
DRAINING_CODE = "backend_draining"  # the model's drain (engine_format/serving.py): it will not come back
KV_TRANSFER_CODE = "kv_transfer_failed"


def model_died(message: str) -> bool:
    """Whether an error message says the replica's model process (or its engine loop) is gone."""
    return any(marker in message for marker in DEAD)


def classify(message: str, backend: str) -> GatewayError:
    """The model's error message -> the client's error (the gRPC stream carries no status code)."""
    if message.startswith("overloaded"):  # runtime.engine Overloaded: the engine's waiting queue is full
        return GatewayError.overloaded(f"backend {backend!r} is overloaded: {message}")
    if message.startswith(KV_TRANSFER_FAILED):
        return GatewayError.unavailable(f"backend {backend!r} could not read the KV: {message}", code=KV_TRANSFER_CODE)
    if message.startswith(("engine error", "internal error")):
        return GatewayError(500, f"backend {backend!r} failed: {message}", "server_error", code="upstream_error")
    if any(marker in message for marker in UNAVAILABLE):  # Triton's own, or the model's drain
        code = DRAINING_CODE if DRAINING in message else "backend_unavailable"
        return GatewayError.unavailable(f"backend {backend!r} is not serving its model: {message}", code=code)
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
        self._open: dict[Any, str | None] = {}  # open generation calls -> why they were failed (None: not)

    @property
    def stub(self) -> Any:
        """The GRPCInferenceService stub (created lazily: grpc.aio binds to the running event loop)."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.url, options=CHANNEL_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def probe(self) -> bool:
        """Ready by Triton, and its model answers the health request (see the module's docstring)."""
        try:
            answer = await self.stub.ModelReady(pb.ModelReadyRequest(name=self.model), timeout=PROBE_TIMEOUT_S)
            problem = await self._ask_model() if answer.ready else "not ready"
        except (grpc.RpcError, OSError) as exc:
            problem = _rpc_message(exc) if isinstance(exc, grpc.RpcError) else str(exc)
        if problem is not None and model_died(problem):
            self.fail_open(problem)
        self.healthy = problem is None
        return self.healthy

    async def _ask_model(self) -> str | None:
        """None unless the model's answer to a health request says it cannot serve (the message).
        A model without health requests answers something else (a result, or an invalid-input error): serving."""
        request = pb.ModelInferRequest(model_name=self.model)
        request.parameters[HEALTH_PARAMETER].bool_param = True
        call = self.stub.ModelStreamInfer(timeout=MODEL_PROBE_TIMEOUT_S)
        try:
            await call.write(request)
            await call.done_writing()
            response = await call.read()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None  # slow (busy): proves nothing; ModelReady said ready
            raise
        finally:
            call.cancel()
        if response is grpc.aio.EOF or not response.error_message:
            return None
        message: str = response.error_message
        return message if classify(message, self.name).status == 503 else None

    def fail_open(self, why: str) -> None:
        """End every request open on this replica with a 503 (its model is gone: they would never finish)."""
        self.healthy = False
        for call, failed in self._open.items():
            if failed is None:
                self._open[call] = why
                call.cancel()
        if self._open:
            log.warning("backend %s at %s: its model died (%s); failing %d open requests", self.name, self.url,
                        why, len(self._open))  # fmt: skip

    async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        """Deltas of one generation; raises GatewayError. Closing or cancelling the iterator
        before the last delta cancels the upstream request."""
        call = self.stub.ModelStreamInfer()
        self._open[call] = None
        finished = False
        try:
            await call.write(build_request(self.model, request, stream))
            await call.done_writing()
            while (response := await call.read()) is not grpc.aio.EOF:
                if response.error_message:
                    finished = True
                    failure = classify(response.error_message, self.name)
                    if failure.status == 503 and failure.code != KV_TRANSFER_CODE:  # not ready: out until a probe
                        self.healthy = False
                    if model_died(response.error_message):
                        self.fail_open(response.error_message)
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
        except (asyncio.CancelledError, asyncio.InvalidStateError):
            why = self._open.get(call)
            if why is None or _cancelling():  # this task is cancelled (the client left): not our abort
                raise
            finished = True
            raise GatewayError.unavailable(f"backend {self.name!r} failed during the request, which is lost: "
                                           f"{why}", code="backend_failed") from None  # fmt: skip
        finally:
            self._open.pop(call, None)
            if not finished:
                call.cancel()  # the client left (or we failed): Triton cancels the request

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            try:
                await channel.close()
            except (asyncio.CancelledError, grpc.RpcError):  # closing during shutdown
                log.debug("closing the gRPC channel to %s failed", self.url)


def _cancelling() -> bool:
    """Whether the current task is being cancelled (Python 3.10 cannot tell: there, never)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def _rpc_message(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    return str(details() if callable(details) else exc)

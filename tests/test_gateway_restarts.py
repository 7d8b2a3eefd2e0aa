"""A replica whose model process dies, or whose tritonserver restarts: what clients get.

Without servers (fake gRPC calls and upstreams): a dead stub's error is a 503 with Retry-After (never a
400); its first sign, from a request or a probe, fails every request open on that replica at once; a request
that has produced nothing waits (bounded) for a replica to be ready again and is retried there, and a stream
cut mid-answer is resumed there from its token ids (unless it opted out); a backend never seen serving fails at
once.

Against a real tritonserver (slow random Llama, one sequence at a time): its stub is killed under a running
stream and a queued request. The gateway sees the stream cut at once, while tritonserver still runs (before,
it hung until `trtserve serve`'s supervisor killed tritonserver, ~9 s); tritonserver is then restarted on
its ports, as the supervisor does: the queued request and one sent meanwhile are answered in full, and the
stream is resumed from the tokens it had sent, its text equal to the uninterrupted answer's.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from runtime.gateway.errors import GatewayError
from runtime.gateway.exchange import Exchange
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.replica_config import Replica, RoutingSettings
from runtime.gateway.replicas import ReplicaPool
from runtime.gateway.routing import EXPLICIT, Backend, GatewayConfig, RouteDecision, Router
from runtime.gateway.upstream import Upstream, classify, model_died
from runtime.gateway.wire import Delta, GenerateRequest
from runtime.serve.launcher import ServerConfig, TritonServer
from tests.gateway_helpers import build_slow_engine, client, gateway_metrics, replica_entry, running_gateway
from tests.helpers import FLOAT32_BACKEND
from tests.triton_helpers import wait_for

DEAD_STUB = "Stub process 'llm_0_0' is not healthy."
A = "10.0.0.1:8001"
REQUEST = GenerateRequest("hi", None, {})


# --- error mapping ---


@pytest.mark.parametrize(("message", "code"), [
    (DEAD_STUB, "backend_unavailable"),
    ("engine loop stopped: RuntimeError('boom')", "backend_unavailable"),
    ("server shutting down: model 'llm' is not ready for new requests", "backend_draining"),  # not waited for
])  # fmt: skip
def test_a_replica_that_cannot_serve_is_503_with_retry_after_never_400(message, code):
    error = classify(message, "b")
    assert (error.status, error.type, error.code) == (503, "service_unavailable", code)
    assert message in error.message
    response = error.response()
    assert response.headers["Retry-After"] == "5" and response.headers["retry-after-ms"] == "5000"


def test_only_a_dead_process_fails_the_requests_open_there():
    assert model_died(DEAD_STUB) and model_died("engine loop stopped: x")
    assert not model_died("server shutting down: model 'llm' is not ready for new requests")  # a drain
    assert not model_died("overloaded: 16 requests waiting") and not model_died("text_input: required")


# --- failing the open requests of a replica whose model died ---


class FakeCall:
    """A ModelStreamInfer call: answers `responses`, then blocks in read() until cancelled (which, as in
    grpc.aio, makes read() raise CancelledError)."""

    def __init__(self, responses: list[Any]) -> None:
        self.responses = list(responses)
        self.blocked = asyncio.get_running_loop().create_future()
        self.cancelled = False

    async def write(self, message: Any) -> None:
        self.request = message

    async def done_writing(self) -> None:
        pass

    async def read(self) -> Any:
        if self.responses:
            return self.responses.pop(0)
        await self.blocked
        return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        self.blocked.cancel()
        return True


def token_response() -> Any:
    response = pb.ModelStreamInferResponse()
    response.infer_response.model_name = "llm"
    for name, raw in (
        ("text_output", b"\x02\x00\x00\x00Hi"),
        ("finish_reason", b"\x00\x00\x00\x00"),
        ("prompt_tokens", (3).to_bytes(4, "little")),
        ("completion_tokens", (1).to_bytes(4, "little")),
    ):
        response.infer_response.outputs.add(name=name)
        response.infer_response.raw_output_contents.append(raw)
    return response  # fmt: skip


@dataclass
class FakeStub:
    """GRPCInferenceService: each ModelStreamInfer answers the next script entry (a list of responses)."""

    scripts: list[list[Any]]
    ready: bool = True
    calls: list[FakeCall] = field(default_factory=list)

    def ModelStreamInfer(self, timeout: float | None = None) -> FakeCall:
        self.calls.append(FakeCall(self.scripts.pop(0)))
        return self.calls[-1]

    async def ModelReady(self, request: Any, timeout: float | None = None) -> Any:
        return pb.ModelReadyResponse(ready=self.ready)


def fake_upstream(stub: FakeStub) -> Upstream:
    upstream = Upstream("b", A, "llm")
    upstream._channel, upstream._stub = object(), stub  # type: ignore[assignment]
    upstream.healthy = True
    return upstream


async def first_then_rest(upstream: Upstream) -> tuple[asyncio.Task[list[str]], list[str]]:
    """A stream whose first delta has arrived (then blocked in read), collected by a task."""
    deltas = upstream.generate(REQUEST, stream=True)
    first = await anext(deltas)

    async def rest() -> list[str]:
        return [first.text, *[d.text async for d in deltas]]

    return asyncio.create_task(rest()), [first.text]


def test_a_request_told_the_stub_died_fails_every_request_open_on_that_replica():
    async def scenario() -> None:
        stub = FakeStub([[token_response()], [], [pb.ModelStreamInferResponse(error_message=DEAD_STUB)]])
        upstream = fake_upstream(stub)
        streaming, _ = await first_then_rest(upstream)
        waiting = asyncio.create_task(anext(upstream.generate(REQUEST, stream=False)))  # nothing produced yet
        while len(stub.calls) < 2:
            await asyncio.sleep(0)
        with pytest.raises(GatewayError) as told:
            await anext(upstream.generate(REQUEST, stream=True))
        assert told.value.status == 503 and DEAD_STUB in told.value.message
        for task in (streaming, waiting):
            with pytest.raises(GatewayError) as failed:
                await asyncio.wait_for(task, 60)  # (without the fix: they hang, as on a real dead stub)
            assert (failed.value.status, failed.value.code) == (503, "backend_failed")
            assert failed.value.message == f"backend 'b' failed during the request, which is lost: {DEAD_STUB}"
        assert not upstream.healthy and all(call.cancelled for call in stub.calls)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("answer", "healthy", "fails_open"),
    [
        ([pb.ModelStreamInferResponse(error_message=DEAD_STUB)], False, True),
        ([pb.ModelStreamInferResponse(error_message="server shutting down: model 'llm' is not ready")], False, False),
        ([token_response()], True, False),  # the model's "ok"
        ([pb.ModelStreamInferResponse(error_message="text_input: required")], True, False),  # no health requests
    ],
)  # fmt: skip
def test_probes_ask_the_model_itself(answer, healthy, fails_open):
    """Triton says "ready" after the stub died: the probe's health request tells."""

    async def scenario() -> None:
        stub = FakeStub([[token_response()], answer])
        upstream = fake_upstream(stub)
        streaming, _ = await first_then_rest(upstream)
        assert await upstream.probe() is healthy
        probe = stub.calls[1].request
        assert probe.parameters["trtserve_health"].bool_param and probe.model_name == "llm"
        if fails_open:
            with pytest.raises(GatewayError) as failed:
                await asyncio.wait_for(streaming, 60)
            assert failed.value.code == "backend_failed"
        else:
            for _ in range(10):
                await asyncio.sleep(0)
            assert not streaming.done()
            streaming.cancel()

    asyncio.run(scenario())


def test_a_probe_timing_out_proves_nothing():
    class SlowCall(FakeCall):
        async def read(self) -> Any:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata())

    async def scenario() -> bool:
        stub = FakeStub([])
        stub.ModelStreamInfer = lambda timeout=None: SlowCall([])  # type: ignore[method-assign]
        return await fake_upstream(stub).probe()

    assert asyncio.run(scenario()) is True


# --- waiting for a replica to come back ---


@dataclass
class ScriptedUpstream:
    """Each generation raises or yields the next script entry; a 503 marks it unhealthy, as Upstream does."""

    url: str
    script: list[GatewayError | list[Delta | GatewayError]]  # a list: deltas, perhaps cut by an error
    healthy: bool = True
    requests: list[GenerateRequest] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.requests)

    async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        self.requests.append(request)
        step = self.script.pop(0)
        for item in step if isinstance(step, list) else [step]:
            if isinstance(item, GatewayError):
                self.healthy = item.status != 503 and self.healthy
                raise item
            yield item


def single_pool(upstream: ScriptedUpstream, ready_wait_s: float) -> ReplicaPool:
    routing = RoutingSettings(policy="round_robin", ready_wait_s=ready_wait_s)
    made = ReplicaPool("m", "llm", [Replica(upstream.url)], routing, "round_robin",
                       GatewayMetrics.create(CollectorRegistry()))  # fmt: skip
    made.replicas[upstream.url].upstream = upstream  # type: ignore[assignment]
    return made


class Slot:
    async def __aenter__(self) -> float:
        return 0.0

    async def __aexit__(self, *exc: object) -> None:
        return None


async def exchange_texts(p: ReplicaPool, request: GenerateRequest = REQUEST, texts: list[str] | None = None
                         ) -> list[str]:  # fmt: skip
    """The exchange's delta texts (also appended to `texts` as they come)."""
    texts = [] if texts is None else texts
    exchange = Exchange(RouteDecision("m", EXPLICIT), {"m": p}, Router(GatewayConfig({"m": Backend("m", "h:1")})),
                        [request], True, False)  # fmt: skip
    await exchange.start(Slot())
    try:
        async for event in exchange.events():
            texts.append(event.delta.text)
        return texts
    finally:
        await exchange.close()


DOWN = GatewayError.unavailable(f"backend 'm' is not serving its model: {DEAD_STUB}")


def test_a_request_that_produced_nothing_waits_for_the_restarted_replica_and_is_answered():
    async def scenario() -> None:
        upstream = ScriptedUpstream(A, [DOWN, [Delta("Hi", None, 3, 1), Delta("!", "stop", 3, 2)]])
        p = single_pool(upstream, ready_wait_s=3600)
        assert p.healthy  # it has served: none healthy later means a restart
        answer = asyncio.create_task(exchange_texts(p))
        while not p._recovery:  # until the request waits for the replica
            await asyncio.sleep(0)
        assert not answer.done() and upstream.calls == 1
        upstream.healthy = True  # back: the monitor's probe finds it, and publishes
        p.publish_health()
        assert await answer == ["Hi", "!"] and upstream.calls == 2

    asyncio.run(scenario())


def test_a_stream_cut_by_its_replicas_death_is_resumed_there_once_it_is_back():
    """The resumed request carries the token ids passed on; the client's text goes on where it stopped. A
    stream that opted out (resume_on_failure false: not resumable) ends with the error instead."""

    async def scenario(resumable: bool) -> tuple[list[str], ScriptedUpstream, GatewayError | None]:
        cut = [Delta("Hi", None, 3, 1, token_ids=(7,)), Delta(" th", None, 3, 2, token_ids=(8,)), DOWN]
        upstream = ScriptedUpstream(A, [cut, [Delta("ere", "stop", 3, 3, token_ids=(9,))]])
        p = single_pool(upstream, ready_wait_s=3600)
        texts: list[str] = []
        answer = asyncio.create_task(exchange_texts(p, replace(REQUEST, resumable=resumable), texts))
        while not (p._recovery and len(texts) == 2) and not answer.done():  # until it waits for the replica
            await asyncio.sleep(0)
        if answer.done():
            with pytest.raises(GatewayError) as caught:
                await answer
            return texts, upstream, caught.value
        assert texts == ["Hi", " th"] and upstream.calls == 1
        upstream.healthy = True
        p.publish_health()
        await answer
        return texts, upstream, None

    texts, upstream, error = asyncio.run(scenario(resumable=True))
    assert error is None and texts == ["Hi", " th", "ere"]
    assert [r.resume_token_ids for r in upstream.requests] == [(), (7, 8)]
    texts, upstream, error = asyncio.run(scenario(resumable=False))
    assert texts == ["Hi", " th"] and error is DOWN and upstream.calls == 1


def test_the_wait_is_bounded_and_ends_in_a_503_with_retry_after():
    async def scenario() -> GatewayError:
        p = single_pool(ScriptedUpstream(A, [DOWN]), ready_wait_s=0.01)
        assert p.healthy
        with pytest.raises(GatewayError) as caught:
            await exchange_texts(p)
        return caught.value

    error = asyncio.run(scenario())
    assert (error.status, error.retry_after_s) == (503, 5.0)
    assert error.message == f"no replica of backend 'm' was ready again within 0.01 s (last failure: {DOWN.message})"


def test_only_the_time_spent_waiting_counts_against_the_wait():
    """A request waits (its replica restarting), is sent again once the replica is back, sits there for longer
    than ready_wait_s, and the replica fails again: it waits again with what is left of its wait, instead of a
    503 at once. The event loop's clock is the test's: time passes only where the test moves it."""
    clock = [0.0]

    class SlowSecondAttempt(ScriptedUpstream):
        async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
            if self.calls == 1:  # the attempt after the first restart: queued for 100 s, then its replica fails
                clock[0] += 100.0
            async for delta in super().generate(request, stream):
                yield delta

    async def scenario() -> list[str]:
        asyncio.get_running_loop().time = lambda: clock[0]  # type: ignore[method-assign]
        upstream = SlowSecondAttempt(A, [DOWN, DOWN, [Delta("Hi", "stop", 3, 1)]])
        p = single_pool(upstream, ready_wait_s=30)
        answer = asyncio.create_task(exchange_texts(p))
        for calls in (1, 2):  # each failure: the request waits; 2 s later the replica is back
            while not (p._recovery and upstream.calls == calls) and not answer.done():
                await asyncio.sleep(0)
            clock[0] += 2.0
            upstream.healthy = True
            p.publish_health()
        return await answer

    assert asyncio.run(scenario()) == ["Hi"]


def test_a_backend_never_seen_serving_fails_at_once():
    async def scenario() -> GatewayError:
        upstream = ScriptedUpstream(A, [], healthy=False)
        p = single_pool(upstream, ready_wait_s=3600)
        with pytest.raises(GatewayError) as caught:
            await asyncio.wait_for(exchange_texts(p), 60)
        return caught.value

    error = asyncio.run(scenario())
    assert error.status == 503 and error.message == "no healthy replica of backend 'm'"


# --- against a real tritonserver ---

LONG = {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}}


def stub_of(server: TritonServer) -> int:
    """The pid of the `llm` model's stub process of this tritonserver (its child: nobody else's)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.process.pid and any(arg.endswith(b"/models/llm/1/model.py") for arg in command):
            found.append(int(proc.name))
    [pid] = found
    return pid


@pytest.mark.serving
def test_a_dead_stubs_stream_is_resumed_and_waiting_requests_are_answered_after_the_restart(engines_dir, tmp_path):
    engine = build_slow_engine(engines_dir)
    # float32: the resumed stream re-prefills its answer, which may differ from decoding it only by rounding
    params = {"max_num_seqs": "1", "backend": FLOAT32_BACKEND}
    server = TritonServer(ServerConfig.on_free_ports(engine, engine_params=params))
    restarted: TritonServer | None = None
    try:
        server.wait_ready(timeout_s=180)
        routing = {"policy": "round_robin", "health_interval_s": 0.2, "ready_wait_s": 300}
        config = {"backends": {"slow": {"replicas": [replica_entry(server)]}}, "routing": routing}
        patient = tmp_path / "patient.yaml"
        patient.write_text(yaml.safe_dump(config))
        with (running_gateway(None, None, "--config", str(patient)) as gw,
              running_gateway(None, None, "--config", str(patient), "--ready-wait", "0") as impatient,
              ThreadPoolExecutor(3) as pool):  # fmt: skip
            sdk = client(gw.url)
            chat = {"model": "slow", "messages": [{"role": "user", "content": "Go on."}], "logprobs": True,
                    "top_logprobs": 2, **LONG}  # fmt: skip
            chunks = iter(sdk.chat.completions.create(**chat, stream=True))
            first = next(chunks).choices[0]
            assert first.delta.role == "assistant"
            rest = (lp for c in chunks if c.choices for lp in c.choices[0].logprobs.content)
            streamed = pool.submit(lambda: [*first.logprobs.content, *rest])

            def ask(text: str) -> Any:
                return sdk.completions.create(model="slow", prompt=text, max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip

            queued = pool.submit(ask, "Queued behind the stream.")
            url = replica_entry(server)["url"]
            in_flight = f'trtserve_gateway_replica_in_flight{{backend="slow",replica="{url}"}}'
            assert wait_for(lambda: gateway_metrics(gw).get(in_flight) == 2)  # the stream, and one queued behind it
            os.kill(stub_of(server), signal.SIGKILL)
            resumed = f'trtserve_gateway_streams_resumed_total{{backend="slow",replica="{url}"}}'
            assert wait_for(lambda: gateway_metrics(gw).get(resumed) == 1)  # the cut seen at once...
            assert server.process.poll() is None  # ...while tritonserver still runs (not by its end)
            with pytest.raises(openai.InternalServerError) as refused:
                client(impatient.url).completions.create(model="slow", prompt="Now?", max_tokens=2)
            assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"] == "5"
            meanwhile = pool.submit(ask, "Sent while it is down.")
            assert not queued.done() and not meanwhile.done() and not streamed.done()

            os.killpg(server.process.pid, signal.SIGKILL)  # what `trtserve serve`'s supervisor does, then restarts
            server.process.wait()
            restarted = TritonServer(server.config)
            restarted.wait_ready(timeout_s=180)
            for future in (queued, meanwhile):
                answer = future.result(timeout=300)
                assert answer.usage.completion_tokens == 4 and answer.choices[0].finish_reason == "length"
            # The stream went on where it was cut: its tokens are the uninterrupted greedy answer's, up to a near-tie
            # (a random model's logits are flat: prompt and answer prefilled again can flip one, docs/gateway.md).
            tokens = streamed.result(timeout=300)
            reference = sdk.chat.completions.create(**chat).choices[0].logprobs.content
            assert len(tokens) == len(reference) == LONG["max_tokens"]
            assert_equal_up_to_a_near_tie(tokens, reference)
    finally:
        for each in (server, restarted):
            if each is not None:
                each.stop()


def assert_equal_up_to_a_near_tie(tokens: list, reference: list, tie: float = 1e-3) -> None:
    """Greedy tokens (with their top-2) equal the reference's until a position where both runs saw their two
    best tokens within `tie` nats of each other; after it they may differ."""
    for i, (ours, theirs) in enumerate(zip(tokens, reference, strict=True)):
        if ours.token != theirs.token:
            margins = [abs(t.top_logprobs[0].logprob - t.top_logprobs[1].logprob) for t in (ours, theirs)]
            assert max(margins) < tie, (i, margins)
            return

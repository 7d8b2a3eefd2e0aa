"""The served model under a burst of concurrent gRPC streams, each asking for a subset of the outputs
(as the gateway does), some cancelled mid-stream.

Before the fix this killed the Python-backend stub within seconds: the backend drops unrequested
output tensors inside `ResponseSender.send` after releasing the GIL, so their numpy arrays were freed
without it and the heap corrupted (segfaults in _PyObject_Malloc on whichever thread allocated next).
The model now builds only the requested outputs and holds them across the send.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio

from runtime.serve.supervisor import TRITON, Supervisor
from tests.triton_helpers import metric, metrics, running_server, wait_for

pytestmark = pytest.mark.serving

GATEWAY_OUTPUTS = ("text_output", "finish_reason", "prompt_tokens", "completion_tokens")  # no logprobs
STREAMS = 1000  # before the fix: 4 of 5 bursts of 600 or 1,000 streams killed the stub
CANCEL_EVERY = 5  # every fifth stream leaves after its second response
STREAM_TIMEOUT_S = 180  # a dead stub never ends its streams: fail instead of hanging (1,000 took >60 s in CI)


def _chat(index: int) -> list[dict[str, str]]:
    """A chat of a few turns (the chat template runs on the stub's executor threads, Python allocating
    beside the engine thread and the senders: how the gateway's traffic first showed the crash)."""
    turns = [{"role": "system", "content": "You are terse."}]
    for turn in range(index % 3):
        turns += [{"role": "user", "content": f"question {turn}"}, {"role": "assistant", "content": f"answer {turn}"}]
    return [*turns, {"role": "user", "content": f"request {index} " * (1 + index % 8)}]


def _inputs(index: int) -> list[grpcaio.InferInput]:
    values = [
        ("messages", np.array([json.dumps(_chat(index)).encode()], dtype=object), "BYTES"),
        ("max_tokens", np.array([8 + index % 40], dtype=np.int64), "INT64"),
        ("stream", np.array([True]), "BOOL"),
        ("temperature", np.array([0.7], dtype=np.float32), "FP32"),
    ]
    tensors = []
    for name, value, dtype in values:
        tensor = grpcaio.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    return tensors


async def _stream(client: grpcaio.InferenceServerClient, index: int) -> str:
    """One generation; its outcome: "completed", "cancelled" or the error's first words."""

    async def requests():
        yield {
            "model_name": "llm",
            "inputs": _inputs(index),
            "outputs": [grpcaio.InferRequestedOutput(name) for name in GATEWAY_OUTPUTS],
            "request_id": f"burst-{index}",
        }

    call = client.stream_infer(requests(), stream_timeout=STREAM_TIMEOUT_S)
    responses = 0
    try:
        async for result, error in call:
            if error is not None:
                return f"error: {str(error)[:60]}"
            responses += 1
            assert set(result.get_response().outputs[i].name for i in range(len(GATEWAY_OUTPUTS))) == set(
                GATEWAY_OUTPUTS
            ), "the response carries exactly the requested outputs"
            if index % CANCEL_EVERY == 0 and responses == 2:
                call.cancel()
                return "cancelled"
            if result.as_numpy("finish_reason")[0]:  # (deltas coalesced under load: an answer may come whole)
                return "completed" if index % CANCEL_EVERY else "finished before its cancel"
    except asyncio.CancelledError:
        return "cancelled"
    except grpc.aio.AioRpcError as error:
        return f"rpc error: {error.code().name}"
    return "ended without a final response"


async def _burst(url: str) -> Counter[str]:
    async with grpcaio.InferenceServerClient(url) as client:
        outcomes = await asyncio.gather(*(_stream(client, i) for i in range(STREAMS)))
    return Counter(outcomes)


def test_a_burst_of_streams_with_requested_outputs_and_cancels_leaves_the_stub_alive(llama_engine):
    with running_server(llama_engine, {"max_waiting": str(STREAMS), "cancel_poll_s": "0.05"}) as server:
        outcomes = asyncio.run(_burst(f"{server.config.host}:{server.config.grpc_port}"))
        log = server.log_tail(lines=10_000)
        assert "Fatal Python error" not in log, log[-4000:]
        early = outcomes.pop("finished before its cancel", 0)
        assert outcomes == {
            "completed": STREAMS - STREAMS // CANCEL_EVERY,
            "cancelled": STREAMS // CANCEL_EVERY - early,
        }
        assert Supervisor({TRITON: server}).probe(server) is None, "the model still answers its health probe"
        assert wait_for(lambda: metric(metrics(server), "trtserve_kv_cache_usage_ratio") == 0.0, timeout_s=30)

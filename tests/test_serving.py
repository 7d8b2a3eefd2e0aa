"""trtserve behind the real tritonserver binary: HTTP generate / SSE, gRPC streaming, bad
inputs, a 1,000-request burst and Prometheus metrics. (Client cancellation is tested on the
real model, tests/test_serving_smollm2.py: the tiny engine finishes 240 tokens in ~70 ms,
faster than a cancel travels.)

One server per test module, on free ports, serving the tiny Llama engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import aiohttp
import numpy as np
import pytest

from engine_format import EngineConfig
from runtime import LLM, SamplingParams
from tests.triton_helpers import (
    grpc_inputs,
    grpc_stream,
    ignore_eos,
    metric,
    metrics,
    post,
    running_server,
    sse_events,
    wait_for,
)

pytestmark = pytest.mark.serving
MAX_WAITING = 200


@pytest.fixture(scope="module", params=["core-in-a-thread", "core-in-a-process"])
def server(llama_engine, request):
    engine_process = str(request.param == "core-in-a-process").lower()  # EngineArgs.engine_process
    with running_server(llama_engine, {"max_waiting": str(MAX_WAITING), "engine_process": engine_process}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(llama_engine):
    llm = LLM(llama_engine)
    return lambda prompt, n: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n))[0].text


def test_generate_matches_offline_engine(server, reference):
    status, body = post(server, "/v2/models/llm/generate", {"text_input": "Paged attention", "max_tokens": 12})
    assert status == 200, body
    assert body["text_output"] == reference("Paged attention", 12)
    assert body["finish_reason"] in ("length", "stop") and body["completion_tokens"] >= 1
    assert body["prompt_tokens"] > 0


def test_chat_messages_input(server, reference):
    messages = [{"role": "user", "content": "Hi there"}]
    status, body = post(server, "/v2/models/llm/generate", {"messages": json.dumps(messages), "max_tokens": 6})
    assert status == 200, body
    assert body["text_output"] == reference([messages], 6)


def test_generate_stream_concatenates_to_the_whole_answer(server, reference):
    events = sse_events(server, {"text_input": "The quick brown", "max_tokens": 16, "stream": True})
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == reference("The quick brown", 16)
    assert [e["finish_reason"] for e in events[:-1]] == [""] * (len(events) - 1)
    assert events[-1]["finish_reason"] in ("length", "stop")


def test_a_stream_interval_streams_the_same_answer_in_fewer_events(server):
    body = {"text_input": "The quick brown", "max_tokens": 16, "stream": True, "ignore_eos": True}
    every_token = sse_events(server, body)
    events = sse_events(server, {**body, "stream_interval": 5})
    counts, interval_counts = [e["completion_tokens"] for e in every_token], [e["completion_tokens"] for e in events]
    if server.config.engine_params["engine_process"] == "false":
        assert counts == list(range(1, 17))
        assert interval_counts == [1, 6, 11, 16]  # the first token at once, then 5 a response
    else:  # a core in its own process runs ahead: a front end behind gets what came meanwhile as one response
        assert counts == sorted(set(counts)) and counts[-1] == 16
        gaps = [later - earlier for earlier, later in itertools.pairwise(interval_counts)]
        assert all(gap >= 5 for gap in gaps[:-1]) and all(gap > 0 for gap in gaps)  # 5 a response, the last fewer
        assert interval_counts[-1] == 16
    assert "".join(e["text_output"] for e in events) == "".join(e["text_output"] for e in every_token)


def test_32_concurrent_grpc_streams(server, reference):
    client, results = grpc_stream(server)
    prompts = {str(i): f"Request number {i} says" for i in range(32)}
    for request_id, prompt in prompts.items():
        client.async_stream_infer("llm", grpc_inputs(prompt, 10), request_id=request_id)
    texts = {k: "" for k in prompts}
    done: set[str] = set()
    deadline = time.monotonic() + 120
    while len(done) < len(prompts) and time.monotonic() < deadline:
        result, error = results.get(timeout=60)
        assert error is None, error
        request_id = result.get_response().id
        texts[request_id] += result.as_numpy("text_output")[0].decode()
        if result.as_numpy("finish_reason")[0]:
            done.add(request_id)
    client.stop_stream()
    assert done == set(prompts)
    assert texts == {k: reference(p, 10) for k, p in prompts.items()}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 4}, "give exactly one of 'text_input'"),
        ({"text_input": "hi", "max_tokens": -1}, "max_tokens: must be in [1, 2147483647] (got -1)"),
        ({"text_input": "hi", "max_tokens": 2**32 + 8}, "max_tokens: must be in [1, 2147483647] (got 4294967304)"),
        ({"text_input": "hi", "max_token": 4}, "max_token: unknown field; allowed: text_input, messages"),
        ({"messages": "[" * 100_000 + "]" * 100_000}, "messages: is nested more than 32 levels deep"),
        ({"text_input": "hi", "top_p": 1.5}, "top_p: must be in (0, 1] (got 1.5)"),
        ({"text_input": "word " * 300, "max_tokens": 4}, "exceeds the engine's max sequence length"),
        ({"messages": "[not json", "max_tokens": 4}, "messages: is not valid JSON"),
    ],
)
def test_bad_inputs_get_clear_4xx_errors(server, body, message):
    status, reply = post(server, "/v2/models/llm/generate", body)
    assert 400 <= status < 500, reply
    assert message in reply["error"]
    assert post(server, "/v2/models/llm/generate", {"text_input": "still alive", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize(
    "body", [{"text_input": "hi", "max_tokens": "many"}, {"text_input": "hi", "temperature": "hot"}]
)
def test_wrong_json_types_are_rejected_by_triton_with_a_clear_message(server, body):
    """Triton's HTTP frontend parses JSON into the declared tensor types before the model
    sees the request; it answers a type mismatch itself, with HTTP 500 (not ours to change)."""
    status, reply = post(server, "/v2/models/llm/generate", body)
    assert status in (400, 500) and "Unable to parse 'data'" in reply["error"]
    assert post(server, "/v2/models/llm/generate", {"text_input": "still alive", "max_tokens": 2})[0] == 200


def test_non_utf8_bytes_rejected(server):
    client, results = grpc_stream(server)
    inputs = grpc_inputs("x", 4)
    inputs[0].set_data_from_numpy(np.array([b"\xff\xfe bad"], dtype=object))
    client.async_stream_infer("llm", inputs, request_id="bad-bytes")
    _, error = results.get(timeout=30)
    client.stop_stream()
    assert error is not None and "text_input: is not valid UTF-8" in str(error)


def test_burst_of_1000_requests_completes_or_is_rejected(server):
    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"text_input": f"burst {i}", "max_tokens": 8}
        async with session.post(f"{server.config.http_url}/v2/models/llm/generate", json=body) as response:
            reply = await response.json()
            if response.status != 200:
                assert "overloaded" in reply["error"], reply
            else:
                assert reply["completion_tokens"] >= 1
            return response.status

    async def burst() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(1000)))

    start = time.monotonic()
    statuses = asyncio.run(burst())
    elapsed = time.monotonic() - start
    ok, rejected = statuses.count(200), len(statuses) - statuses.count(200)
    assert ok + rejected == 1000 and ok >= MAX_WAITING
    assert set(statuses) <= {200, 400}, set(statuses)  # Triton's generate maps model errors to 400
    assert wait_for(lambda: metric(metrics(server), "trtserve_kv_cache_used_blocks") == 0)
    print(f"burst: {ok} completed, {rejected} overloaded in {elapsed:.1f} s")


def test_overload_is_a_fast_error_over_grpc_streams(server):
    """Fill the waiting queue past max_waiting on one gRPC stream: the excess requests fail
    at once with the overload error while the admitted ones complete. (The model raises
    TritonError UNAVAILABLE; a gRPC stream carries per-request errors as messages only.)"""
    client, results = grpc_stream(server)
    total = MAX_WAITING + 150
    for i in range(total):
        client.async_stream_infer("llm", grpc_inputs(f"load {i}", 32, stream=False) + ignore_eos(), request_id=str(i))
    outcomes = [results.get(timeout=120) for _ in range(total)]
    client.stop_stream()
    errors = [e for _, e in outcomes if e is not None]
    assert errors and all("overloaded" in str(e) for e in errors)
    assert total - len(errors) >= MAX_WAITING


def test_metrics_are_present_and_moving(server, llama_engine):
    before = metrics(server)
    post(server, "/v2/models/llm/generate", {"text_input": "count me", "max_tokens": 5})
    assert wait_for(lambda: metric(metrics(server), "trtserve_generation_tokens_total")
                    > metric(before, "trtserve_generation_tokens_total"))  # fmt: skip
    after = metrics(server)
    for name in ("trtserve_time_to_first_token_seconds_count", "trtserve_inter_token_latency_seconds_count",
                 "trtserve_queue_time_seconds_count", "trtserve_e2e_request_latency_seconds_count",
                 "trtserve_prompt_tokens_total"):  # fmt: skip
        assert metric(after, name) > metric(before, name), name
    present = (
        "trtserve_kv_cache_usage_ratio",
        "trtserve_num_requests_running",
        "trtserve_num_requests_waiting",
        "trtserve_prefix_cache_hits_total",
        "trtserve_prefix_cache_queries_total",
        "trtserve_preemptions_total",
    )
    for name in present:
        assert any(k.split("{")[0] == name for k in after), name
    config = EngineConfig.load(llama_engine)  # capacity: the pool's blocks as sequences of max_seq_len
    blocks = metric(after, "trtserve_kv_cache_blocks_total")
    assert blocks > 0 and metric(after, "trtserve_kv_cache_max_concurrency") == pytest.approx(
        blocks * config.block_size / config.max_seq_len
    )


def test_tritonclient_http_infer_through_the_adapter_model(server, reference):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.config.http_port}")

    def infer(text: str, max_tokens: int):
        inputs = []
        for name, value, dtype in (("text_input", np.array([text.encode()], dtype=object), "BYTES"),
                                   ("max_tokens", np.array([max_tokens], dtype=np.int64), "INT64")):  # fmt: skip
            tensor = httpclient.InferInput(name, [1], dtype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        return client.infer("llm_infer", inputs)

    try:
        result = infer("Request and response", 9)
        assert result.as_numpy("text_output")[0].decode() == reference("Request and response", 9)
        assert result.as_numpy("finish_reason")[0] in (b"length", b"stop")
        with pytest.raises(InferenceServerException, match="max_tokens: must be in"):
            infer("bad", -2)
    finally:
        client.close()  # Triton's graceful shutdown waits for open HTTP connections

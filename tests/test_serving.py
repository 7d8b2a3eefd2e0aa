"""trtserve behind the real tritonserver binary: HTTP generate / SSE, gRPC streaming,
cancellation, bad inputs, a 1,000-request burst and Prometheus metrics.

One server per test session, on free ports, serving the tiny Llama engine.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from runtime import LLM, SamplingParams
from runtime.serve.launcher import ServerConfig, TritonServer

pytestmark = pytest.mark.serving
MAX_WAITING = 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(llama_engine):
    config = ServerConfig(
        llama_engine, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        engine_params={"max_waiting": str(MAX_WAITING)},
    )  # fmt: skip
    with TritonServer(config) as srv:
        srv.wait_ready(timeout_s=180)
        yield srv
        assert srv.process.poll() is None, "tritonserver died during the tests:\n" + srv.log_tail()


@pytest.fixture(scope="module")
def reference(llama_engine):
    llm = LLM(llama_engine)
    return lambda prompt, n: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n))[0].text


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.config.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def sse_events(server, body: dict) -> list[dict]:
    request = urllib.request.Request(
        f"{server.config.http_url}/v2/models/llm/generate_stream", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return [json.loads(line[5:]) for line in response.read().decode().splitlines() if line.startswith("data:")]


def metrics(server) -> dict[str, float]:
    url = f"http://{server.config.host}:{server.config.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(trtserve_\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match:
            key = match.group(1) + (match.group(2) or "")
            values[key] = float(match.group(3))
    return values


def metric(values: dict[str, float], name: str) -> float:
    return sum(v for k, v in values.items() if k.split("{")[0] == name)


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


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


def grpc_inputs(text: str, max_tokens: int, stream: bool = True) -> list:
    values = [("text_input", np.array([text.encode()], dtype=object), "BYTES"),
              ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
              ("stream", np.array([stream]), "BOOL")]  # fmt: skip
    inputs = []
    for name, value, dtype in values:
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def test_32_concurrent_grpc_streams(server, reference):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.config.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
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


def test_client_cancellation_aborts_and_frees_kv_blocks(server):
    aborted = 'trtserve_request_success_total{finish_reason="abort",model="llm",version="1"}'
    before = metrics(server)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.config.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("llm", grpc_inputs("cancel me", 240) + ignore_eos(), request_id="cancel-me")
    result, error = results.get(timeout=30)  # streaming has started: the request holds KV blocks
    assert error is None and result.as_numpy("finish_reason")[0] == b""
    client.stop_stream(cancel_requests=True)
    # Counted as "abort", not "length": it was stopped before its 240 tokens.
    assert wait_for(lambda: metrics(server)[aborted] >= before[aborted] + 1), metrics(server)
    # Gauges are refreshed every 0.5 s, the finish counter at once: wait for the next refresh.
    assert wait_for(lambda: metric(metrics(server), "trtserve_kv_cache_used_blocks") == 0)


def ignore_eos() -> list:
    tensor = grpcclient.InferInput("ignore_eos", [1], "BOOL")
    tensor.set_data_from_numpy(np.array([True]))
    return [tensor]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 4}, "give exactly one of 'text_input'"),
        ({"text_input": "hi", "max_tokens": -1}, "max_tokens: must be in [1, inf] (got -1)"),
        ({"text_input": "hi", "top_p": 1.5}, "top_p: must be in (0.0, 1.0] (got 1.5)"),
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
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.config.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
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
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.config.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    total = MAX_WAITING + 150
    for i in range(total):
        client.async_stream_infer("llm", grpc_inputs(f"load {i}", 8, stream=False), request_id=str(i))
    outcomes = [results.get(timeout=120) for _ in range(total)]
    client.stop_stream()
    errors = [e for _, e in outcomes if e is not None]
    assert errors and all("overloaded" in str(e) for e in errors)
    assert total - len(errors) >= MAX_WAITING


def test_metrics_are_present_and_moving(server):
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


def test_tritonclient_http_infer_through_the_adapter_model(server, reference):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.config.http_port}")

    def infer(text: str, max_tokens: int):
        inputs = []
        for name, value, dtype in (("text_input", np.array([text.encode()], dtype=object), "BYTES"),
                                   ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")):  # fmt: skip
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

"""Gateway limits and cancellation against a live tritonserver, through the `openai` SDK.

The engine is a random Llama slow enough (~50 tokens/s) that a long request is still running
when the test acts on it, served with one sequence at a time and one waiting slot, so the
engine's own overload is reachable. Two gateways share it: `open_gw` (default limits) and
`strict_gw` (an API key, one upstream slot, one queue place). Every test leaves the engine idle.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from runtime.serve.launcher import free_port
from tests.gateway_helpers import build_slow_engine, client, gateway_metrics, running_gateway
from tests.triton_helpers import metric, metrics, running_server, wait_for

pytestmark = pytest.mark.serving
MODEL = "slow"
KEY = "sk-test-0123456789"
LONG = {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}}
ABORTED = 'trtserve_request_success_total{finish_reason="abort",model="llm",version="1"}'


def ask(sdk: openai.OpenAI, text: str, **kwargs):
    return sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kwargs)


@pytest.fixture(scope="module")
def triton(engines_dir):
    with running_server(build_slow_engine(engines_dir), {"max_num_seqs": "1", "max_waiting": "1"}) as server:
        yield server


@pytest.fixture(scope="module")
def open_gw(triton):
    with running_gateway(triton.config.grpc_port, MODEL) as gw:
        yield gw


@pytest.fixture(scope="module")
def strict_gw(triton):
    limits = ("--max-concurrent", "1", "--max-queued", "1")
    with running_gateway(triton.config.grpc_port, MODEL, *limits, api_key=KEY) as gw:
        yield gw


@pytest.fixture(autouse=True)
def idle_engine(triton):
    """Each test starts and ends with no request running or waiting and no KV block held."""

    def idle() -> bool:
        values = metrics(triton)
        return all(metric(values, f"trtserve_{name}") == 0 for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_used_blocks"))  # fmt: skip

    assert wait_for(idle, timeout_s=30)
    yield
    assert wait_for(idle, timeout_s=30), metrics(triton)


def started_stream(sdk: openai.OpenAI, text: str):
    """A long streamed chat whose first chunk has arrived: it holds a slot and KV blocks now."""
    stream = ask(sdk, text, stream=True, **LONG)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    return stream


def test_client_disconnect_cancels_upstream_and_frees_kv_blocks(triton, open_gw):
    sdk = client(open_gw.url)
    before, gw_before = metrics(triton), gateway_metrics(open_gw)
    stream = started_stream(sdk, "Tell me a long story.")
    assert wait_for(lambda: metric(metrics(triton), "trtserve_kv_cache_used_blocks") > 0)
    stream.close()  # drops the connection mid-stream
    # Triton counts the request as aborted (not finished by length) and frees its blocks.
    assert wait_for(lambda: metrics(triton).get(ABORTED, 0) == before.get(ABORTED, 0) + 1), metrics(triton)
    assert wait_for(lambda: metric(metrics(triton), "trtserve_kv_cache_used_blocks") == 0)
    tokens = "trtserve_generation_tokens_total"
    generated = metric(metrics(triton), tokens) - metric(before, tokens)
    assert 1 <= generated < 600, generated  # stopped well before its 1,500 tokens
    cancelled = 'trtserve_gateway_cancelled_total{endpoint="/v1/chat/completions"}'
    assert gateway_metrics(open_gw)[cancelled] == gw_before.get(cancelled, 0) + 1
    assert ask(sdk, "Still there?", max_tokens=3).usage.completion_tokens == 3


def pending_request(gateway_url: str, text: str, api_key: str = "unused") -> http.client.HTTPConnection:
    """A non-streaming chat sent on its own connection, its answer not awaited: closing the
    connection is the client leaving, at a moment the test chooses."""
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(gateway_url).netloc, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": LONG["max_tokens"],
            "ignore_eos": True}  # fmt: skip
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    return connection


def test_disconnect_while_waiting_in_the_engine_cancels_too(triton, open_gw):
    sdk = client(open_gw.url)
    before = metrics(triton)
    running = started_stream(sdk, "Keep the engine busy.")
    waiting = pending_request(open_gw.url, "I will not wait.")
    try:
        assert wait_for(lambda: metric(metrics(triton), "trtserve_num_requests_waiting") == 1)
    finally:
        waiting.close()
    assert wait_for(lambda: metrics(triton).get(ABORTED, 0) == before.get(ABORTED, 0) + 1), metrics(triton)
    assert metric(metrics(triton), "trtserve_num_requests_running") == 1  # the first one runs on
    running.close()
    assert wait_for(lambda: metrics(triton).get(ABORTED, 0) == before.get(ABORTED, 0) + 2), metrics(triton)


def test_engine_overload_is_429_with_retry_after(triton, open_gw):
    sdk = client(open_gw.url)
    running = started_stream(sdk, "First, running.")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(started_stream, sdk, "Second, waiting.")  # the engine's one waiting slot
        assert wait_for(lambda: metric(metrics(triton), "trtserve_num_requests_waiting") == 1)
        with pytest.raises(openai.RateLimitError) as whole:
            ask(sdk, "Third, refused.", max_tokens=4)
        with pytest.raises(openai.RateLimitError) as streamed:  # a stream's status waits for its first token
            ask(sdk, "Fourth, refused.", max_tokens=4, stream=True)
        running.close()  # the waiting request runs now, and its stream starts
        waiting.result(timeout=60).close()
    for error in (whole.value, streamed.value):
        assert error.status_code == 429 and error.code == "overloaded" and "overloaded" in error.message
        assert int(error.response.headers["Retry-After"]) >= 1


def test_gateway_queue_full_is_429_and_a_queued_client_leaving_frees_its_place(triton, strict_gw):
    """strict_gw: one upstream slot, one queue place. A third request is refused; the queued one,
    whose client then leaves, leaves the queue without ever reaching the engine."""
    sdk = client(strict_gw.url, KEY)
    depth = "trtserve_gateway_queue_depth"
    before = metrics(triton)
    running = started_stream(sdk, "Holding the only slot.")
    queued = pending_request(strict_gw.url, "Queued.", KEY)
    try:
        assert wait_for(lambda: gateway_metrics(strict_gw)[depth] == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            ask(sdk, "No room.", max_tokens=4)
        queued.close()
        assert wait_for(lambda: gateway_metrics(strict_gw)[depth] == 0)
    finally:
        queued.close()
        running.close()
    assert "queue is full" in caught.value.message and caught.value.code == "overloaded"
    assert int(caught.value.response.headers["Retry-After"]) >= 1
    values, tenants = gateway_metrics(strict_gw), gateway_metrics(strict_gw, "/admin/metrics", KEY)
    tenant = "key:" + hashlib.sha256(KEY.encode()).hexdigest()[:12]  # the fairness key: a digest of the API key
    assert tenants[f'trtserve_gateway_queue_rejections_total{{key="{tenant}"}}'] == 1
    assert not any("key=" in name for name in values)  # per-tenant series stay off the public page
    assert not any(KEY in name for name in [*values, *tenants])  # the key itself never becomes a label
    # The engine saw one request, the running one (aborted); the queued one never reached it.
    assert wait_for(lambda: metrics(triton).get(ABORTED, 0) == before.get(ABORTED, 0) + 1)
    assert wait_for(lambda: metric(metrics(triton), "trtserve_num_requests_running") == 0)
    finished = "trtserve_request_success_total"
    assert metric(metrics(triton), finished) == metric(before, finished) + 1
    assert wait_for(lambda: gateway_metrics(strict_gw)["trtserve_gateway_in_flight"] == 0)


@pytest.mark.parametrize("key", ["sk-wrong", KEY[:-1], KEY + "0", KEY.upper()])
def test_wrong_api_key_is_401(strict_gw, key):
    sdk = client(strict_gw.url, key)
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        ask(sdk, "hi", max_tokens=2)
    assert [m.id for m in client(strict_gw.url, KEY).models.list()] == [MODEL]


@pytest.mark.parametrize("header", [None, KEY, f"Basic {KEY}", f"Bearer {KEY}x"])
def test_missing_or_malformed_authorization_is_401(strict_gw, header):
    headers = {"Content-Type": "application/json", **({"Authorization": header} if header else {})}
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(f"{strict_gw.url}/v1/chat/completions", data=body, headers=headers)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 401 and json.loads(caught.value.read())["error"]["code"] == "invalid_api_key"


def test_no_healthy_backend_is_503():
    with running_gateway(free_port(), "nowhere", healthy=False) as gw:  # nothing listens there
        sdk = client(gw.url)
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.chat.completions.create(model="nowhere", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 503 and "no healthy backend" in caught.value.message
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{gw.url}/health", timeout=10)
        assert health.value.code == 503

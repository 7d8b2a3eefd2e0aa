"""Triton's KServe v2 HTTP routes through the gateway (`--triton-http-url`), against a real tritonserver.

The slow random Llama, started as `trtserve serve` starts its gateway (start_beside_triton: --triton-url,
--triton-http-url, --tenants): generate, generate_stream (events as they arrive) and infer (also through
tritonclient.http) answer as Triton does directly; a form-urlencoded body (what kills Triton 2.51's own HTTP
frontend at a few MB) is a 415 and an oversized one a 413, and Triton lives on; a client leaving a stream
cancels it in the engine; keys, tenant limits and KServe's error shape apply. Without a server: the
tenant's cache salt replaces the client's in both request shapes.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml

from runtime.gateway.errors import GatewayError
from runtime.gateway.process import GatewayProcess, start_beside_triton
from runtime.gateway.protocol import MAX_BODY_BYTES
from runtime.gateway.routing import GatewayConfig
from runtime.gateway.service import Gateway, GatewaySettings
from runtime.gateway.tenants import tenant_cache_salt, tenants_from
from runtime.gateway.triton_http import salted
from runtime.serve.launcher import TritonServer, free_port
from tests.gateway_helpers import build_slow_engine, gateway_metrics, running_servers
from tests.triton_helpers import metric, metrics, wait_for

KEY, SMALL = "sk-door-0123456789", "sk-small-0123456789"
TENANTS = {"tenants": {"main": {"key": KEY, "admin": True}, "small": {"key": SMALL, "max_concurrent": 1,
                                                                      "max_queued": 0}}}  # fmt: skip
ABORTED = 'trtserve_request_success_total{finish_reason="abort",model="llm",version="1"}'
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


# --- the tenant's cache salt, without a server ---


def test_the_tenants_salt_replaces_the_clients_in_generate_and_infer_bodies():
    config = GatewayConfig.single("m", "h:1")
    gateway = Gateway(GatewayConfig(config.backends, tenants=tenants_from("tenants", TENANTS["tenants"])),
                      GatewaySettings())  # fmt: skip
    [main, _] = gateway.tenants
    body = {"text_input": "hi", "cache_salt": "mine"}
    salted(gateway, main, body, inputs=False)
    assert body == {"text_input": "hi", "cache_salt": tenant_cache_salt(KEY, "mine")}
    body = {"text_input": "hi"}
    salted(gateway, main, body, inputs=False)
    assert body["cache_salt"] == tenant_cache_salt(KEY, None)
    infer = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
                        {"name": "cache_salt", "datatype": "BYTES", "shape": [1], "data": ["mine"]}]}  # fmt: skip
    salted(gateway, main, infer, inputs=True)
    assert infer["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
                               {"name": "cache_salt", "datatype": "BYTES", "shape": [1],
                                "data": [tenant_cache_salt(KEY, "mine")]}]  # fmt: skip
    keyless = Gateway(config, GatewaySettings())
    body = {"text_input": "hi"}
    salted(keyless, None, body, inputs=False)
    assert body == {"text_input": "hi"}  # no key, no client salt: the shared cache, as on /v1
    for bad, inputs in (({"cache_salt": 5}, False), ({"inputs": "x"}, True),
                        ({"inputs": [{"name": "cache_salt", "data": ["a", "b"]}]}, True)):  # fmt: skip
        with pytest.raises(GatewayError) as caught:
            salted(gateway, main, bad, inputs)
        assert caught.value.status == 400


# --- against a real tritonserver ---


@pytest.fixture(scope="module")
def triton(engines_dir) -> Iterator[TritonServer]:
    with running_servers(build_slow_engine(engines_dir), 1, {"max_num_seqs": "2"}) as [server]:
        yield server


@pytest.fixture(scope="module")
def gateway(triton, tmp_path_factory) -> Iterator[GatewayProcess]:
    tenants = tmp_path_factory.mktemp("door") / "tenants.yaml"
    tenants.write_text(yaml.safe_dump(TENANTS))
    config = triton.config
    gw = start_beside_triton(f"0.0.0.0:{config.grpc_port}", "slow", "127.0.0.1", free_port(), None,
                             http_address=f"{config.host}:{config.http_port}", tenants=tenants)  # fmt: skip
    try:
        yield gw
        assert gw.process.poll() is None, "the gateway died during the tests:\n" + gw.log_tail()
    finally:
        gw.stop()


def call(url: str, path: str, body: bytes | dict | None = None, key: str | None = KEY,
         content_type: str = "application/json", method: str | None = None) -> tuple[int, dict, bytes]:  # fmt: skip
    """(status, headers (lower-case names), body) of one request."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{url}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def events(raw: bytes) -> list[dict]:
    return [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data:")]


@pytest.mark.serving
def test_generate_and_its_stream_answer_as_triton_does(triton, gateway):
    body = {"text_input": "The observatory", **GREEDY}
    direct = call(triton.config.http_url, "/v2/models/llm/generate", body, key=None)
    door = call(gateway.url, "/v2/models/llm/generate", body)
    assert door[0] == direct[0] == 200
    assert json.loads(door[2])["text_output"] == json.loads(direct[2])["text_output"]
    assert json.loads(door[2])["completion_tokens"] == 6
    streamed = call(gateway.url, "/v2/models/llm/generate_stream", {**body, "stream": True})
    assert streamed[0] == 200 and streamed[1]["content-type"].startswith("text/event-stream")
    chunks = events(streamed[2])
    assert "".join(c["text_output"] for c in chunks) == json.loads(direct[2])["text_output"]
    # A token a response, or several where the stream fell behind the engine core (its process runs ahead).
    counts = [c["completion_tokens"] for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 6 and chunks[-1]["finish_reason"] == "length"


@pytest.mark.serving
def test_infer_answers_as_triton_does_also_to_tritonclient(triton, gateway):
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["The observatory"]},
                       {"name": "max_tokens", "datatype": "INT64", "shape": [1], "data": [6]},
                       {"name": "temperature", "datatype": "FP32", "shape": [1], "data": [0.0]}]}  # fmt: skip
    direct = call(triton.config.http_url, "/v2/models/llm_infer/infer", body, key=None)
    door = call(gateway.url, "/v2/models/llm_infer/infer", body)
    assert door[0] == direct[0] == 200

    def text(raw: bytes) -> str:
        return next(o["data"][0] for o in json.loads(raw)["outputs"] if o["name"] == "text_output")

    assert text(door[2]) == text(direct[2])
    sdk = httpclient.InferenceServerClient(gateway.url.removeprefix("http://"))
    inputs = []
    for name, value, datatype in (("text_input", np.array([b"The observatory"], np.object_), "BYTES"),
                                  ("max_tokens", np.array([6], np.int64), "INT64"),
                                  ("temperature", np.array([0.0], np.float32), "FP32")):  # fmt: skip
        tensor = httpclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value, binary_data=False)  # binary request tensors are refused (415)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput("text_output")]  # binary output: passed through with its header
    result = sdk.infer("llm_infer", inputs, outputs=outputs, headers={"Authorization": f"Bearer {KEY}"})
    assert result.as_numpy("text_output")[0].decode() == text(direct[2])
    assert sdk.is_server_ready(headers={"Authorization": f"Bearer {KEY}"})
    assert sdk.get_model_metadata("llm", headers={"Authorization": f"Bearer {KEY}"})["name"] == "llm"


@pytest.mark.serving
def test_health_is_public_and_the_rest_needs_a_key_with_kserve_errors(gateway):
    assert call(gateway.url, "/v2/health/ready", key=None)[0] == 200
    assert call(gateway.url, "/v2/health/live", key=None)[0] == 200
    status, _, raw = call(gateway.url, "/v2/models/llm/config")
    assert status == 200 and json.loads(raw)["name"] == "llm"
    for path, body in (("/v2/models/llm", None), ("/v2/models/llm/generate", {"text_input": "hi"})):
        for key in (None, "sk-nobody"):
            status, _, raw = call(gateway.url, path, body, key=key)
            assert (status, json.loads(raw)) == (401, {"error": "Incorrect API key provided"})
    status, _, raw = call(gateway.url, "/v2/models/llm/repository", {}, method="POST")
    assert status == 404
    status, _, raw = call(gateway.url, "/v2/models/llm/generate", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]
    # Triton answers this one 200 with an error body; the gateway says what is wrong, with a 4xx
    status, _, raw = call(gateway.url, "/v2/models/llm/generate", {"text_input": "hi", "max_tokens": 4, "stream": True})
    assert status == 400 and "/generate_stream" in json.loads(raw)["error"]


@pytest.mark.serving
def test_form_and_oversized_bodies_are_refused_and_triton_lives_on(triton, gateway):
    form = b"a=" + b"b" * 5_000_000  # a few MB of form-urlencoded: what kills Triton's own HTTP frontend
    status, _, raw = call(
        gateway.url, "/v2/models/llm/generate", form, content_type="application/x-www-form-urlencoded"
    )
    assert status == 415 and "application/json" in json.loads(raw)["error"]
    connection = http.client.HTTPConnection(gateway.host, gateway.port, timeout=60)
    connection.putrequest("POST", "/v2/models/llm/generate")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Authorization", f"Bearer {KEY}")
    connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))  # refused on the header: nothing more is read
    connection.endheaders(b"{")
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())["error"]) == (413, f"the request body exceeds "
                                                                              f"{MAX_BODY_BYTES} bytes")  # fmt: skip
    connection.close()
    # No length declared: read to the limit. The gateway answers there and closes; a client still sending then
    # gets a reset (nothing reads the rest), and reads the answer that came before it.
    connection = http.client.HTTPConnection(gateway.host, gateway.port, timeout=120)
    connection.putrequest("POST", "/v2/models/llm/generate")
    for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                        ("Transfer-Encoding", "chunked")):  # fmt: skip
        connection.putheader(name, value)
    connection.endheaders()
    try:
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            connection.send(b"%x\r\n%s\r\n" % (2**20, b" " * 2**20))
        connection.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())["error"]) == (413, f"the request body exceeds "
                                                                              f"{MAX_BODY_BYTES} bytes")  # fmt: skip
    connection.close()
    assert triton.process.poll() is None
    assert call(triton.config.http_url, "/v2/health/ready", key=None)[0] == 200
    status, _, raw = call(gateway.url, "/v2/models/llm/generate", {"text_input": "Still", **GREEDY})
    assert status == 200 and json.loads(raw)["completion_tokens"] == 6


def long_stream(gateway: GatewayProcess, key: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A 1,500-token generate_stream whose first event has arrived."""
    connection = http.client.HTTPConnection(gateway.host, gateway.port, timeout=60)
    body = {"text_input": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    connection.request("POST", "/v2/models/llm/generate_stream", json.dumps(body),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the first event
    return connection, response


def engine_idle(triton: TritonServer) -> bool:
    values = metrics(triton)
    return metric(values, "trtserve_num_requests_running") == 0 and metric(values, "trtserve_num_requests_waiting") == 0


@pytest.mark.serving
def test_a_client_leaving_a_stream_cancels_it_in_the_engine(triton, gateway):
    assert wait_for(lambda: engine_idle(triton), timeout_s=60)
    before = metrics(triton).get(ABORTED, 0)
    connection, _ = long_stream(gateway, KEY)
    connection.close()
    assert wait_for(lambda: metrics(triton).get(ABORTED, 0) == before + 1, timeout_s=30)
    assert wait_for(lambda: engine_idle(triton), timeout_s=30)
    generated = metric(metrics(triton), "trtserve_generation_tokens_total")
    assert wait_for(lambda: metric(metrics(triton), "trtserve_generation_tokens_total") == generated)


@pytest.mark.serving
def test_a_tenant_at_its_limit_gets_429_here_too(triton, gateway):
    connection, _ = long_stream(gateway, SMALL)  # the tenant's one slot
    try:
        status, headers, raw = call(gateway.url, "/v2/models/llm/generate", {"text_input": "hi", **GREEDY}, SMALL)
        assert status == 429 and "queue is full" in json.loads(raw)["error"] and int(headers["retry-after"]) >= 1
        assert call(gateway.url, "/v2/models/llm/generate", {"text_input": "hi", **GREEDY})[0] == 200  # others: served
    finally:
        connection.close()
    assert wait_for(lambda: engine_idle(triton), timeout_s=30)
    # The gateway releases the slot as its handler ends, after it cancelled the engine's request (CI saw a 429
    # between the two): wait for its own count, then the tenant is served again.
    assert wait_for(lambda: gateway_metrics(gateway)["trtserve_gateway_in_flight"] == 0, timeout_s=30)
    status, _, _ = call(gateway.url, "/v2/models/llm/generate", {"text_input": "hi", **GREEDY}, SMALL)
    assert status == 200  # the slot came back when the stream's client left


def test_start_beside_triton_passes_the_http_door_tenants_and_the_spare(monkeypatch, tmp_path: Path):
    """What `trtserve serve` runs: the options the gateway gets (the process itself is not started here)."""
    seen: list[list[str]] = []

    class Recorder:
        def __init__(self, args: list[str], host: str, port: int, api_key: str | None) -> None:
            seen.append(args)

        def wait_ready(self, **_: object) -> None:
            pass

    monkeypatch.setattr("runtime.gateway.process.GatewayProcess", Recorder)
    start_beside_triton("0.0.0.0:8001", "m", "127.0.0.1", 9000, None, http_address="0.0.0.0:8000",
                        tenants=tmp_path / "t.yaml", standby_address="127.0.0.1:8101")  # fmt: skip
    assert seen == [["--triton-url", "127.0.0.1:8001", "--model", "m", "--nice", "10", "--standby-url",
                     "127.0.0.1:8101", "--triton-http-url", "http://127.0.0.1:8000", "--tenants",
                     str(tmp_path / "t.yaml")]]  # fmt: skip

"""For tests against the real tritonserver: a server on free ports, and clients for HTTP
generate / SSE, gRPC streams and the Prometheus metrics endpoint."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from runtime.serve.launcher import ServerConfig, TritonServer


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


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def grpc_inputs(text: str, max_tokens: int, stream: bool = True) -> list:
    values = [("text_input", np.array([text.encode()], dtype=object), "BYTES"),
              ("max_tokens", np.array([max_tokens], dtype=np.int64), "INT64"),
              ("stream", np.array([stream]), "BOOL")]  # fmt: skip
    inputs = []
    for name, value, dtype in values:
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def ignore_eos() -> list:
    tensor = grpcclient.InferInput("ignore_eos", [1], "BOOL")
    tensor.set_data_from_numpy(np.array([True]))
    return [tensor]


def grpc_stream(server) -> tuple[grpcclient.InferenceServerClient, queue.Queue]:
    """A gRPC client with a started stream; its (result, error) callbacks land in the queue."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.config.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    return client, results


@contextlib.contextmanager
def running_server(engine: Path, engine_params: dict[str, str] | None = None) -> Iterator[TritonServer]:
    """tritonserver serving `engine` on free ports; checks on exit that it did not die."""
    config = ServerConfig.on_free_ports(engine, engine_params=engine_params or {})
    with TritonServer(config) as server:
        server.wait_ready(timeout_s=180)
        yield server
        assert server.process.poll() is None, "tritonserver died during the tests:\n" + server.log_tail()

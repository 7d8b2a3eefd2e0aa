"""`trtserve serve` as a user runs it: the OpenAI endpoint comes up next to tritonserver (or not,
with --no-openai), is printed with the other endpoints, and goes away on SIGTERM."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from runtime.gateway.process import BESIDE_ENGINE_NICE
from runtime.serve.launcher import free_port
from tests.gateway_helpers import client

pytestmark = pytest.mark.serving
TRTSERVE = Path(sys.executable).parent / "trtserve"


class Serve:
    """`trtserve serve` in a child process; its output lines land in a queue (read without blocking)."""

    def __init__(self, engine: Path, *args: str) -> None:
        self.ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
        command = [str(TRTSERVE), "serve", "--engine", str(engine), *args,
                   *(f"--{name}-port={port}" for name, port in self.ports.items())]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()

    def output_until(self, marker: str, timeout_s: float = 120) -> str:
        seen = []
        while not any(marker in line for line in seen):
            try:
                seen.append(self.lines.get(timeout=timeout_s))
            except queue.Empty:
                pytest.fail(f"no {marker!r} in `trtserve serve` output:\n{''.join(seen)}")
        return "".join(seen)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=90)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def gateway_nice(port: int) -> int:
    """How much lower than this test's the CPU priority of the gateway listening on `port` is."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"runtime.gateway" in command and str(port).encode() in command:
            return os.getpriority(os.PRIO_PROCESS, int(proc.name)) - os.getpriority(os.PRIO_PROCESS, 0)
    raise AssertionError(f"no gateway process listens on {port}")


def test_serve_starts_the_openai_endpoint_and_stops_it(llama_engine):
    serve = Serve(llama_engine)
    try:
        ready = serve.output_until("OpenAI")
        assert f"OpenAI   http://127.0.0.1:{serve.ports['openai']}/v1 (model '{llama_engine.name}'" in ready
        sdk = client(f"http://127.0.0.1:{serve.ports['openai']}")
        assert [m.id for m in sdk.models.list()] == [llama_engine.name]
        reply = sdk.chat.completions.create(model=llama_engine.name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.usage.completion_tokens == 3
        # Beside the engine, the gateway yields the cores (nice is capped at 19).
        assert gateway_nice(serve.ports["openai"]) == min(BESIDE_ENGINE_NICE, 19 - os.getpriority(os.PRIO_PROCESS, 0))
    finally:
        code = serve.stop()
    assert code == 0, serve.output_until("stopping tritonserver")
    assert not listening(serve.ports["openai"])


def test_no_openai_flag(llama_engine):
    serve = Serve(llama_engine, "--no-openai")
    try:
        ready = serve.output_until("metrics  http")
        assert "OpenAI" not in ready and not listening(serve.ports["openai"])
    finally:
        assert serve.stop() == 0

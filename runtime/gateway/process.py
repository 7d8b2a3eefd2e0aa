"""The gateway as a child process (`python -m runtime.gateway`): started by `trtserve serve`, and tests.

A separate process keeps the gateway's event loop off the CPU the caller needs, and its crash
off the caller. The API key travels in the environment, not on the command line (ps shows that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from runtime.gateway.cli import API_KEY_ENV

# `trtserve serve` runs the gateway at this lower CPU priority beside its engine, which uses every core
# in parallel steps: a gateway thread that preempts one engine thread stalls the other at the step's
# barrier, so each gateway CPU ms costs the engine about two. Niced, the gateway runs in the engine's
# serial gaps instead (SmolLM2, 2-core Xeon, c=32: gateway / direct-Triton throughput 0.905 -> 0.972,
# ~4 ms more TTFT; benchmarks/results/gateway-steady-fixed*.md).
BESIDE_ENGINE_NICE = 10


class GatewayProcessError(RuntimeError):
    pass


class GatewayProcess:
    def __init__(self, args: list[str], host: str, port: int, api_key: str | None = None,
                 log_path: Path | None = None, cwd: Path | None = None) -> None:  # fmt: skip
        """`args`: `trtserve gateway` options other than --host/--port/--api-key; `cwd`: where it runs, hence
        which checkout's `runtime` it imports (benchmarks.gateway_profile compares two)."""
        self.host, self.port = host, port
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="trtserve-gateway-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if api_key:
            env[API_KEY_ENV] = api_key
        command = [sys.executable, "-m", "runtime.gateway", *args, "--host", host, "--port", str(port)]
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=cwd)  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(
        self, timeout_s: float = 60.0, healthy: bool = True, backend_alive: Callable[[], bool] = lambda: True
    ) -> None:
        """Until GET /health answers 200 (a backend is ready), or answers at all with healthy=False;
        raises GatewayProcessError with the log's tail, at once when `backend_alive()` turns false."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise GatewayProcessError(f"the gateway exited (code {self.process.returncode}):\n{self.log_tail()}")
            if not backend_alive():
                raise GatewayProcessError("its backend died while the gateway started")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return  # 200
            except urllib.error.HTTPError:
                if not healthy:
                    return  # it answers: 503, no backend ready
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise GatewayProcessError(f"the gateway was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # uvicorn: stop accepting, finish open requests
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_beside_triton(
    grpc_address: str,
    model: str,
    host: str,
    port: int,
    api_key: str | None,
    http_address: str | None = None,
    tenants: Path | None = None,
    triton_alive: Callable[[], bool] = lambda: True,
    standby_address: str | None = None,
) -> GatewayProcess:
    """The gateway `trtserve serve` runs next to its tritonserver (at `grpc_address`), ready to serve.
    `http_address`: tritonserver's HTTP host:port, whose KServe routes the gateway then serves (the safe door:
    Triton's own HTTP port stays on loopback); `tenants`: a file with a `tenants:` section (instead of `api_key`);
    `triton_alive`: false once that tritonserver died (the wait for the gateway's readiness ends at once);
    `standby_address`: a warm spare tritonserver's gRPC host:port (a standby replica)."""
    args = ["--triton-url", _reachable(grpc_address), "--model", model, "--nice", str(BESIDE_ENGINE_NICE)]
    if standby_address is not None:
        args += ["--standby-url", _reachable(standby_address)]
    if http_address is not None:
        args += ["--triton-http-url", f"http://{_reachable(http_address)}"]
    if tenants is not None:
        args += ["--tenants", str(tenants)]
    gateway = GatewayProcess(args, host, port, api_key)
    try:
        gateway.wait_ready(backend_alive=triton_alive)
    except GatewayProcessError:
        gateway.stop()
        raise
    return gateway


def _reachable(address: str) -> str:
    """host:port as a client reaches it: a server listening everywhere is reached on loopback."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    return f"{host}:{port}"

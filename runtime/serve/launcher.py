"""Start the real `tritonserver` (from the nvidia-pytriton wheel) with the trtserve model.

Builds, in a temp dir, a backend directory (the Python backend library, its utils module
and the stub for the running Python) and a model repository whose `llm/config.pbtxt` is
the project's template with the engine settings filled in and whose `model.py` is the
project's. The stub runs the first `python` on PATH, so the running interpreter's bin/ goes
first. Shutdown sends SIGTERM (Triton unloads models, draining in-flight requests).

The shared-memory, model-repository, logging and trace APIs (HTTP and gRPC) need the `admin-key`
header (a random key unless one is given): no client needs them, and registering the stub's own
IPC region through the shared-memory API crashed Triton. Each server gets its own Python-backend
shared-memory prefix, whose regions are removed after it exits (a crashed stub leaves them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_format.serving import MODEL_NAME

ADAPTER_MODELS = ("llm_infer",)  # forward to MODEL_NAME; copied as they are
TEMPLATE_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
ADMIN_HEADER = "admin-key"  # HTTP header; gRPC clients send it as `triton-grpc-protocol-admin-key`
# Everything but health, metadata, model-config, statistics and inference: no client needs them.
ADMIN_APIS = ("shared-memory", "model-repository", "logging", "trace")
SHM_ROOT = Path("/dev/shm")
PATH_PARAMS = frozenset({"engine_dir", "draft_engine"})  # config.pbtxt parameters naming directories


class ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    engine_dir: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    engine_params: dict[str, str] = field(default_factory=dict)  # config.pbtxt parameters
    log_verbose: int = 0
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    drain_timeout_s: float = 30.0  # Triton's own exit timeout is set above it: trtserve cuts first

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @classmethod
    def on_free_ports(cls, engine_dir: Path, **kwargs: Any) -> ServerConfig:
        """Ports the OS reports free now (tests, benchmarks, examples: several servers side by side)."""
        return cls(engine_dir, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **kwargs)


_HANDED_OUT: set[int] = set()  # ports free_port() returned in this process: never twice
LOWEST_PORT = 10_000


def free_port() -> int:
    """A port nothing listens on, for a server started next. Outside the kernel's ephemeral range when it can:
    there bind(0), outgoing connections and other servers' own listeners (UCX's under NIXL) take ports at
    any moment, so one picked there could be taken before our server binds it (seen: a health probe answered
    by a binary protocol). Never a port this process handed out already, bound yet or not."""
    low = _ephemeral_low()
    for _ in range(200):
        port = secrets.randbelow(low - LOWEST_PORT) + LOWEST_PORT if low > LOWEST_PORT + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise ServerError("found no free TCP port on 127.0.0.1")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: bind(0) picks


def process_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command: state, ppid, pgrp, ...; OSError once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def pytriton_paths() -> tuple[Path, Path]:
    """(tritonserver dir inside the pytriton package, its bundled shared libraries)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("the Triton server comes from nvidia-pytriton: pip install 'trtserve[serve]'")
    package = Path(spec.submodule_search_locations[0])
    return package / "tritonserver", package.parent / "nvidia_pytriton.libs"


def prepare(config: ServerConfig, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """Write backend dir + model repository into workdir; return (command, environment).

    With TRTSERVE_TRITONSERVER_DIR set (e.g. /opt/tritonserver in NVIDIA's container), that
    installation's binary and backends are used; otherwise the ones in nvidia-pytriton."""
    installed = os.environ.get("TRTSERVE_TRITONSERVER_DIR")
    if installed:
        binary, backends, libs = Path(installed) / "bin" / "tritonserver", Path(installed) / "backends", None
    else:
        binary, backends, libs = _pytriton_backends(workdir)
    model_dir = workdir / "models" / MODEL_NAME
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").symlink_to(TEMPLATE_REPOSITORY / MODEL_NAME / "1" / "model.py")
    for adapter in ADAPTER_MODELS:
        (workdir / "models" / adapter / "1").mkdir(parents=True)
        for name in ("config.pbtxt", "1/model.py"):
            (workdir / "models" / adapter / name).symlink_to(TEMPLATE_REPOSITORY / adapter / name)
    params = {"engine_dir": str(config.engine_dir), **config.engine_params}
    for key in PATH_PARAMS & {k for k, v in params.items() if v}:  # the model runs elsewhere: absolute paths
        params[key] = str(Path(params[key]).resolve())
    if params.get("lora_modules"):  # NAME=DIR pairs (EngineArgs checked them): the directories too
        pairs = (entry.partition("=") for entry in params["lora_modules"].split(",") if entry.strip())
        params["lora_modules"] = ",".join(f"{name.strip()}={Path(path.strip()).resolve()}" for name, _, path in pairs)
    restricted = f"{','.join(ADMIN_APIS)}:{ADMIN_HEADER}={config.admin_key}"
    (model_dir / "config.pbtxt").write_text(fill_parameters(
        (TEMPLATE_REPOSITORY / MODEL_NAME / "config.pbtxt").read_text(), params))  # fmt: skip
    command = [
        str(binary),
        f"--model-repository={workdir / 'models'}",
        f"--backend-directory={backends}",
        f"--http-address={config.host}", f"--http-port={config.http_port}",
        f"--grpc-address={config.host}", f"--grpc-port={config.grpc_port}",
        f"--metrics-address={config.host}", f"--metrics-port={config.metrics_port}",
        "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
        "--exit-on-error=true", f"--exit-timeout-secs={int(config.drain_timeout_s) + 30}",
        f"--log-verbose={config.log_verbose}",
        f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix(workdir)}",
    ]  # fmt: skip
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # The stub embeds libpython: make it load the running interpreter's own (whose extension
    # modules it will import) rather than another 3.x.y build found on the system.
    libpython_dir = sysconfig.get_config_var("LIBDIR") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None
    env["LD_LIBRARY_PATH"] = os.pathsep.join(str(p) for p in (libpython_dir, libs, env.get("LD_LIBRARY_PATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return command, env


def _pytriton_backends(workdir: Path) -> tuple[Path, Path, Path]:
    """A backend dir of symlinks into nvidia-pytriton (the stub for the running Python);
    returns (tritonserver binary, backend dir, bundled shared libraries)."""
    server_dir, libs = pytriton_paths()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    backend = workdir / "backends" / "python"
    backend.mkdir(parents=True)
    for source in (
        server_dir / "backends" / "python" / "libtriton_python.so",
        server_dir / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        (backend / source.name).symlink_to(source)
    return server_dir / "bin" / "tritonserver", workdir / "backends", libs


def shm_prefix(workdir: Path) -> str:
    """The Python backend's /dev/shm region prefix for the server in `workdir` (unique per server)."""
    return f"trtserve_{re.sub(r'[^A-Za-z0-9]', '', workdir.name.removeprefix('trtserve-triton-'))}_"


def remove_shm_regions(prefix: str) -> list[str]:
    """Remove /dev/shm regions named `prefix`* (left by a stub or server that did not exit cleanly)."""
    removed = []
    for region in SHM_ROOT.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            region.unlink()
            removed.append(region.name)
    return removed


def fill_parameters(template: str, params: dict[str, str]) -> str:
    """Set `string_value` of each named parameter in the config.pbtxt text (values escaped); parameters the
    template does not list (engine settings: any EngineArgs field) are added after it."""
    added = []
    for key, value in params.items():
        pattern = re.compile(r'(key: "' + re.escape(key) + r'", value: \{ string_value: )"[^"]*"')
        if pattern.search(template):
            template = pattern.sub(_quoted_value(value), template)
        else:
            added.append(f"parameters {{ key: {pbtxt_string(key)}, value: {{ string_value: {pbtxt_string(value)} }} }}")
    return template.rstrip("\n") + "".join(f"\n{line}" for line in added) + "\n"


def _quoted_value(value: str) -> Callable[[re.Match[str]], str]:
    """A re.sub replacement keeping the matched prefix and quoting `value` (taken literally)."""
    quoted = pbtxt_string(value)
    return lambda m: f"{m.group(1)}{quoted}"


def pbtxt_string(value: str) -> str:
    """`value` as a protobuf text-format string literal: a `"` or `\\` in a path must not end or
    corrupt the literal (Triton would read another path, or refuse the config)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    escaped = re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\{ord(m.group()):03o}", escaped)
    return f'"{escaped}"'


class TritonServer:
    """A running tritonserver; use as a context manager or call stop()."""

    def __init__(self, config: ServerConfig, log_path: Path | None = None):
        self.config = config
        self.workdir = Path(tempfile.mkdtemp(prefix="trtserve-triton-"))
        command, env = prepare(config, self.workdir)
        self.shm_prefix = shm_prefix(self.workdir)
        self.model_dir = self.workdir / "models" / MODEL_NAME  # its drain and heartbeat files (serving.py)
        self.log_path = log_path or self.workdir / "tritonserver.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        self._terminated = False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until all models are ready; raises ServerError with the log's tail if the server dies."""
        url = f"{self.config.http_url}/v2/health/ready"  # every model loaded
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited (code {self.process.returncode}):\n{self.log_tail()}"
                                  + "".join(f"\n{line}" for line in self.load_failures()))  # fmt: skip
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def load_failures(self) -> list[str]:
        """The log's model load failures (their reason, e.g. too little memory, is far above the tail)."""
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line[:2000] for line in lines if "failed to load '" in line and ": " in line.partition("version")[2]]

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        """SIGTERM (once): Triton unloads its models and exits; stop() waits for it. Several servers stop at once
        so: each may take seconds."""
        if self.process.poll() is None and not self._terminated:
            self.process.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, SIGKILL after `timeout_s`; then the stubs and /dev/shm regions a crash leaves."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # Its stubs too, at once: a stub outliving it aborts on the IPC (boost's lock_exception), and its
                # faulthandler's "Fatal Python error" in the log would read as a crash of the model.
                self.kill()
        with contextlib.suppress(ProcessLookupError):  # Python-backend stubs left by a crash
            os.killpg(self.process.pid, signal.SIGKILL)
        remove_shm_regions(self.shm_prefix)
        self._log.close()
        shutil.rmtree(self.workdir / "backends", ignore_errors=True)
        shutil.rmtree(self.workdir / "models", ignore_errors=True)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL tritonserver and its stubs at once (the model is dead: nothing left to drain);
        its clients' connections close, so they get an error instead of waiting."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

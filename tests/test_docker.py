"""docker/Dockerfile cannot be built here (no Docker engine): parse it with the official
parser and check that every path it copies and every command it runs exists."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import tomllib

dockerfile = pytest.importorskip("dockerfile")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def commands():
    return dockerfile.parse_file(str(ROOT / "docker" / "Dockerfile"))


def test_based_on_nvidia_triton_container(commands):
    assert commands[0].cmd == "ARG" and "nvcr.io/nvidia/tritonserver:" in commands[0].value[0]
    assert [c.cmd for c in commands if c.cmd == "FROM"] == ["FROM"]


def test_copied_paths_exist(commands):
    copies = [c for c in commands if c.cmd == "COPY"]
    assert copies
    for copy in copies:
        for source in copy.value[:-1]:
            assert (ROOT / source).exists(), source


def test_commands_are_the_projects_console_scripts(commands):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = next(c for c in commands if c.cmd == "ENTRYPOINT")
    assert entrypoint.json and entrypoint.value[0] in scripts and entrypoint.value[1] == "serve"
    assert "0.0.0.0" in entrypoint.value  # listens on the container's interfaces
    runs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    assert "build-engine --model smollm2-135m" in runs and "build-engine" in scripts
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("kernels", "gpu"):
        assert extra in extras and f"{extra}" in runs


def test_exposed_ports_are_the_serve_defaults(commands):
    from runtime.serve.launcher import ServerConfig

    exposed = {int(p) for c in commands if c.cmd == "EXPOSE" for p in c.value}
    defaults = ServerConfig(engine_dir=Path("."))
    assert exposed == {defaults.http_port, defaults.grpc_port, defaults.metrics_port}


def test_container_tritonserver_layout_is_what_the_launcher_expects(tmp_path, monkeypatch):
    """With TRTSERVE_TRITONSERVER_DIR (set in the image) the launcher uses that install."""
    from runtime.serve.launcher import ServerConfig, prepare

    env_line = next(c for c in dockerfile.parse_file(str(ROOT / "docker" / "Dockerfile")) if c.cmd == "ENV")
    assert "TRTSERVE_TRITONSERVER_DIR" in env_line.value
    monkeypatch.setenv("TRTSERVE_TRITONSERVER_DIR", "/opt/tritonserver")
    command, _ = prepare(ServerConfig(engine_dir=tmp_path), tmp_path / "work")
    assert command[0] == "/opt/tritonserver/bin/tritonserver"
    assert "--backend-directory=/opt/tritonserver/backends" in command
    assert shlex.join(command)  # a well-formed command line

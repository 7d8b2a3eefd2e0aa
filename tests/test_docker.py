"""docker/Dockerfile cannot be built here (no Docker engine): parse it with the official
parser and check that every path it copies and every command it runs exists."""

from __future__ import annotations

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


def test_every_installed_package_is_copied(commands):
    """`pip install -e .` in the image installs what pyproject's package find lists: each of
    those packages must have been copied in, or the console scripts fail on import."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {source.rstrip("/") for c in commands if c.cmd == "COPY" for source in c.value[:-1]}
    assert include
    for pattern in include:
        assert pattern.removesuffix("*") in copied, pattern


def test_commands_are_the_projects_console_scripts(commands):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = next(c for c in commands if c.cmd == "ENTRYPOINT")
    assert entrypoint.json and entrypoint.value[0] in scripts and entrypoint.value[1] == "serve"
    assert "0.0.0.0" in entrypoint.value  # listens on the container's interfaces
    runs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    assert "build-engine --model smollm2-135m" in runs and "build-engine" in scripts
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("kernels", "gpu", "gateway", "disagg"):  # gateway: `serve` starts the OpenAI endpoint; disagg: NIXL
        assert extra in extras and f"{extra}" in runs


def test_exposed_ports_are_the_serve_defaults(commands):
    from runtime.gateway.cli import DEFAULT_PORT
    from runtime.serve.launcher import ServerConfig

    exposed = {int(p) for c in commands if c.cmd == "EXPOSE" for p in c.value}
    defaults = ServerConfig(engine_dir=Path("."))
    assert exposed == {defaults.http_port, defaults.grpc_port, defaults.metrics_port, DEFAULT_PORT}


def test_container_tritonserver_command_is_what_the_image_needs(commands, tmp_path, monkeypatch):
    """With TRTSERVE_TRITONSERVER_DIR (set in the image) the launcher runs that install's
    tritonserver with its backends, on the ENTRYPOINT's host and the EXPOSEd ports, over a
    model repository holding the `llm` model."""
    from engine_format.serving import MODEL_NAME
    from runtime.serve.launcher import ServerConfig, prepare

    env = next(c for c in commands if c.cmd == "ENV").value
    install = env[env.index("TRTSERVE_TRITONSERVER_DIR") + 1]
    monkeypatch.setenv("TRTSERVE_TRITONSERVER_DIR", install)
    entrypoint = next(c for c in commands if c.cmd == "ENTRYPOINT").value
    host = entrypoint[entrypoint.index("--triton-host") + 1]
    work = tmp_path / "work"
    command, _ = prepare(ServerConfig(engine_dir=tmp_path, host=host), work)

    assert command[0] == f"{install}/bin/tritonserver"
    options = [arg.removeprefix("--").split("=", 1) for arg in command[1:]]
    assert all(arg.startswith("--") and len(kv) == 2 for arg, kv in zip(command[1:], options, strict=True)), command
    flags = dict(options)
    assert len(flags) == len(options), "an option given twice"
    assert flags["backend-directory"] == f"{install}/backends"
    assert not (work / "backends").exists()  # nothing of nvidia-pytriton's is set up
    assert {flags[f"{e}-address"] for e in ("http", "grpc", "metrics")} == {host}
    exposed = {int(p) for c in commands if c.cmd == "EXPOSE" for p in c.value}
    assert {int(flags[f"{e}-port"]) for e in ("http", "grpc", "metrics")} < exposed  # and the gateway's
    model = Path(flags["model-repository"]) / MODEL_NAME
    assert (model / "1" / "model.py").is_file()
    assert f'string_value: "{tmp_path.resolve()}"' in (model / "config.pbtxt").read_text()

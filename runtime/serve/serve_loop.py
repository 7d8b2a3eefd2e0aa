"""The life of `trtserve serve` once its tritonserver is started: ready, gateway, supervise, drain, stop.

Exit codes: 0 after a clean shutdown; 1 when the server could not start; EXIT_UNSERVABLE when the
model (or tritonserver, or the gateway) stopped serving; EXIT_CUT when the shutdown had to cut
requests at the drain deadline.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import click

from runtime.serve.launcher import MODEL_NAME, ServerError, TritonServer
from runtime.serve.supervisor import STOP_TIMEOUT_S, Supervisor

ADMIN_KEY_ENV = "TRTSERVE_ADMIN_KEY"
EXIT_UNSERVABLE = 3
EXIT_CUT = 4


class Gateway(Protocol):
    """The OpenAI gateway process (runtime.gateway.process.GatewayProcess; this layer may not import it)."""

    @property
    def url(self) -> str: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def process(self) -> subprocess.Popen[bytes]: ...

    def stop(self) -> int: ...


# Starts the gateway beside tritonserver (given its gRPC address), ready to serve.
GatewayStarter = Callable[[str], Gateway]


def run_serve(server: TritonServer, start_gateway: GatewayStarter | None, served_name: str, health_interval_s: float,
              startup_errors: tuple[type[Exception], ...] = ()) -> int:  # fmt: skip
    """Returns the exit code. `startup_errors`: the gateway's start-up failures, reported like the server's."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    config, supervisor = server.config, Supervisor(server, probe_interval_s=health_interval_s)
    openai: Gateway | None = None
    errors: tuple[type[Exception], ...] = (ServerError, *startup_errors)
    try:
        click.echo(f"starting tritonserver (log: {server.log_path}) ...", err=True)
        server.wait_ready()
        if start_gateway is not None:
            openai = start_gateway(f"{config.host}:{config.grpc_port}")
        triton = f"{config.host}:{config.http_port}"
        click.echo(f"ready: model '{MODEL_NAME}'\n"
                   f"  HTTP     http://{triton}/v2/models/{MODEL_NAME}/generate (and generate_stream)\n"
                   f"  gRPC     {config.host}:{config.grpc_port}\n"
                   f"  metrics  http://{config.host}:{config.metrics_port}/metrics")  # fmt: skip
        if openai is not None:
            click.echo(f"  OpenAI   {openai.url}/v1 (model '{served_name}'; log: {openai.log_path})")
        others = {"the OpenAI gateway": openai.process} if openai is not None else {}
        failure = supervisor.watch(stop, others)
    except errors as exc:
        click.echo(f"Error: {exc}", err=True)
        _stop(server, openai)
        return 1
    except BaseException:  # a bug of ours must not leave tritonserver (in its own session) running
        _stop(server, openai)
        raise
    if failure is not None:
        click.echo(f"Error: {failure}\nstopping: the server cannot serve", err=True)
        server.kill()  # a dead model never finishes its requests: closing the connections ends them now
        _stop(server, openai)
        return EXIT_UNSERVABLE
    click.echo(f"draining: new requests are refused; running ones have {config.drain_timeout_s:g} s", err=True)
    result = supervisor.drain(config.drain_timeout_s)
    _stop(server, openai)
    if not result.clean:
        what = f"{result.cut} request(s)" if result.complete else "requests (the model stopped reporting)"
        click.echo(f"Error: the shutdown cut {what} at the drain deadline", err=True)
        return EXIT_CUT
    return 0


def _stop(server: TritonServer, openai: Gateway | None) -> None:
    if openai is not None:
        click.echo("stopping the OpenAI gateway ...", err=True)
        openai.stop()
    click.echo("stopping tritonserver ...", err=True)
    running = server.process.poll() is None
    if server.stop(timeout_s=STOP_TIMEOUT_S) == -signal.SIGKILL and running:
        # Triton 2.51 can hang in shutdown (e.g. after a gRPC stream it rejected was cancelled); its shared
        # memory regions are removed all the same.
        click.echo(f"tritonserver did not exit within {STOP_TIMEOUT_S:g} s: killed", err=True)

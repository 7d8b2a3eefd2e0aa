"""The life of `trtserve serve` once its tritonserver is started: ready, gateway, supervise, restart, drain, stop.

A child that cannot serve is restarted, not the whole server stopped: a dead or stuck model (or a dead
tritonserver) means a new tritonserver on the same ports with the engine loaded again (killing the old
one closes its connections, so in-flight requests end with an error at once and the gateway retries those
that had produced nothing, and resumes the streams); a dead gateway is started again on its port. With a
warm spare (a second tritonserver with the engine loaded, on ports of its own, which the gateway picks only
while the first cannot serve; by default where memory allows, runtime/cli_standby.py) those requests go on at
once instead of after the restart; a dead spare is restarted the same way. Restarts back off and are capped per
minute (runtime.serve.restarts); past the cap the server stops with EXIT_UNSERVABLE for an orchestrator to
decide (a spare is dropped instead).

Exit codes: 0 after a clean shutdown; 1 when the server could not start; EXIT_UNSERVABLE when a child kept
failing past the restart budget; EXIT_CUT when the shutdown had to cut requests at the drain deadline;
EXIT_CRASHED when the model's stub crashed while stopping (its Python stacks are in the log).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import click

from engine_format.serving import MODEL_NAME
from runtime.serve.launcher import ServerConfig, ServerError, TritonServer
from runtime.serve.restarts import RestartBudget
from runtime.serve.standby import Memory, spare_fits
from runtime.serve.supervisor import STANDBY, STOP_TIMEOUT_S, TRITON, Failure, Supervisor

ADMIN_KEY_ENV = "TRTSERVE_ADMIN_KEY"
EXIT_UNSERVABLE = 3
EXIT_CUT = 4
EXIT_CRASHED = 5
GATEWAY = "the OpenAI gateway"  # Failure.child for the gateway
CRASH_MARKER = "Fatal Python error"  # what the stub's faulthandler writes into the log on a fatal signal


class Gateway(Protocol):
    """The OpenAI gateway process (runtime.gateway.process.GatewayProcess; this layer may not import it)."""

    @property
    def url(self) -> str: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def process(self) -> subprocess.Popen[bytes]: ...

    def stop(self) -> int: ...


# Starts the gateway beside tritonserver (given its gRPC and HTTP addresses, the warm spare's gRPC address if there
# is one, and whether tritonserver still runs), ready to serve.
GatewayStarter = Callable[[str, str, str | None, Callable[[], bool]], Gateway]


class _Children:
    """The running tritonservers (the serving one, and a warm spare) and gateway, replaced when they die."""

    def __init__(
        self,
        server: TritonServer,
        start_gateway: GatewayStarter | None,
        served_name: str,
        standby: ServerConfig | None = None,
        standby_memory: Callable[[], Memory] | None = None,
    ) -> None:
        self.servers: dict[str, TritonServer] = {TRITON: server}  # by Failure.child name; STANDBY once it serves
        self.start_gateway, self.served_name, self.standby_config = start_gateway, served_name, standby
        self.standby_memory = standby_memory  # read before the spare starts (None: it starts whatever memory says)
        self.starting_standby: TritonServer | None = None  # until it is ready (then in `servers`)
        self._standby_lock = threading.Lock()  # the thread that waits for it, against a stop meanwhile
        self.gateway: Gateway | None = None
        self.announced = False  # the endpoints are printed once everything first serves
        self.crash_logs: list[Path] = []  # logs of tritonservers whose stub crashed
        self.crashed_at_exit = False

    @property
    def server(self) -> TritonServer:
        return self.servers[TRITON]

    @property
    def gateway_addresses(self) -> tuple[str, str, str | None]:
        """tritonserver's gRPC and HTTP addresses, and the spare's gRPC address (None without one; the gateway
        treats a spare that is still starting as an unhealthy replica)."""
        config, standby = self.server.config, self.standby_config
        spare = f"{standby.host}:{standby.grpc_port}" if standby is not None else None
        return f"{config.host}:{config.grpc_port}", f"{config.host}:{config.http_port}", spare

    def _triton_alive(self) -> bool:
        return self.server.process.poll() is None

    def others(self) -> dict[str, subprocess.Popen[bytes]]:
        return {GATEWAY: self.gateway.process} if self.gateway is not None else {}

    def start(self, errors: tuple[type[Exception], ...]) -> Failure | None:
        """Tritonserver, then the gateway. Once tritonserver has been ready, a child that fails is the
        supervisor's to restart (the Failure); before that, the server could not start (`errors` propagate)."""
        self.server.wait_ready()
        self._start_standby()
        try:
            if self.start_gateway is not None:
                self.gateway = self.start_gateway(*self.gateway_addresses, self._triton_alive)
        except errors as exc:
            if self.server.process.poll() is not None:  # tritonserver died while the gateway started
                return Failure(
                    TRITON,
                    f"tritonserver exited (code {self.server.process.returncode}) while the "
                    f"gateway started:\n{self.server.log_tail()}",
                )
            return Failure(GATEWAY, f"the gateway failed to start: {exc}")
        self.announce()
        return None

    def _start_standby(self) -> None:
        """The warm spare, once tritonserver is ready (started beside it, the two loads would share the CPU). It loads
        while the gateway starts and the first requests are served (supervised once it is ready); left out, with a
        note, when memory does not hold it (unless --standby asked for it) or it cannot start."""
        if self.standby_config is None:
            return
        if self.standby_memory and (refused := spare_fits(self.server.process.pid, self.standby_memory())):
            click.echo(f"no warm spare: {refused} (--standby starts one anyway)", err=True)
            self.standby_config = None
            return
        click.echo("starting the standby tritonserver (a warm spare) ...", err=True)
        try:
            spare = self.starting_standby = TritonServer(self.standby_config)
        except ServerError as exc:
            click.echo(f"warning: serving without a warm spare, which could not start: {exc}", err=True)
            self.standby_config = None
            return
        threading.Thread(target=self._await_standby, args=(spare,), name="trtserve-standby", daemon=True).start()

    def _await_standby(self, spare: TritonServer) -> None:
        try:
            spare.wait_ready()
        except ServerError as exc:
            with self._standby_lock:
                if self.starting_standby is not spare:  # the server stops: it stopped the spare
                    return
                self.starting_standby = self.standby_config = None
            spare.stop(timeout_s=0)
            click.echo(f"warning: serving without a warm spare, which could not start: {exc}", err=True)
            return
        with self._standby_lock:
            if self.starting_standby is spare:
                self.servers[STANDBY], self.starting_standby = spare, None
                click.echo(f"the standby tritonserver is ready ({spare.config.http_url})", err=True)

    def announce(self) -> None:
        if not self.announced:
            _print_endpoints(self, self.served_name)
            self.announced = True

    def restart(self, child: str) -> None:
        if child in self.servers:
            dead = self._discard(self.servers[child])
            self.servers[child] = TritonServer(dead.config)  # the same ports: the gateway finds it there again
            self.servers[child].wait_ready()
        if self.start_gateway is not None and (child == GATEWAY or self.gateway is None):  # (None: it never started)
            if self.gateway is not None:
                self.gateway.stop()
            self.gateway = self.start_gateway(*self.gateway_addresses, self._triton_alive)

    def drop_standby(self, reason: str) -> None:
        """Serve on without the warm spare (it kept failing: the restart budget is for what serves)."""
        self._discard(self.servers.pop(STANDBY))
        self.standby_config = None
        click.echo(f"warning: serving on without the warm spare, which kept failing; last: {reason}", err=True)

    def _discard(self, dead: TritonServer) -> TritonServer:
        dead.kill()  # a dead model never finishes its requests: closing the connections ends them now
        self._note_crash(dead)
        dead.stop(timeout_s=0)
        return dead

    def cancel_standby_start(self) -> None:
        """Stop a spare that is still loading (the server stops): from now on `servers` does not change."""
        with self._standby_lock:
            spare, self.starting_standby = self.starting_standby, None
        if spare is not None:
            spare.stop(timeout_s=0)

    def kill(self) -> None:
        self.cancel_standby_start()
        for server in list(self.servers.values()):
            server.kill()

    def stop(self) -> None:
        self.cancel_standby_start()
        if self.gateway is not None:
            click.echo("stopping the OpenAI gateway ...", err=True)
            self.gateway.stop()
        crashed = False
        servers = list(self.servers.items())
        running = {name for name, server in servers if server.process.poll() is None}
        for _, server in servers:  # all at once: each takes seconds to unload
            server.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, server in servers:
            click.echo(f"stopping {name} ...", err=True)
            if server.stop(timeout_s=max(deadline - time.monotonic(), 0)) == -signal.SIGKILL and name in running:
                # Triton 2.51 can hang in shutdown (e.g. after a gRPC stream it rejected was cancelled); its shared
                # memory regions are removed all the same.
                click.echo(f"{name} did not exit within {STOP_TIMEOUT_S:g} s: killed", err=True)
            crashed = self._note_crash(server) or crashed
        self.crashed_at_exit = crashed

    def _note_crash(self, server: TritonServer) -> bool:
        crashed = CRASH_MARKER in server.log_path.read_text(errors="replace")
        if crashed:
            self.crash_logs.append(server.log_path)
        return crashed


def run_serve(
    server: TritonServer,
    start_gateway: GatewayStarter | None,
    served_name: str,
    health_interval_s: float,
    startup_errors: tuple[type[Exception], ...] = (),
    stall_s: float = 60.0,
    budget: RestartBudget | None = None,
    standby: ServerConfig | None = None,
    standby_memory: Callable[[], Memory] | None = None,
) -> int:
    """Returns the exit code. `startup_errors`: the gateway's start-up failures, reported like the server's;
    `stall_s`: how long a model may show no progress with work unfinished before it is restarted; `standby`: a
    warm spare's tritonserver (its own ports), started once `server` is ready where `standby_memory()` holds a
    second engine the size of the first (None: whatever the memory)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children = _Children(server, start_gateway, served_name, standby, standby_memory)
    budget = budget or RestartBudget()
    errors: tuple[type[Exception], ...] = (ServerError, *startup_errors)
    try:
        click.echo(f"starting tritonserver (log: {server.log_path}) ...", err=True)
        failure = children.start(errors)
        failure = _supervise(children, stop, budget, errors, health_interval_s, stall_s, failure)
    except errors as exc:
        click.echo(f"Error: {exc}", err=True)
        children.stop()
        return 1
    except BaseException:  # a bug of ours must not leave tritonserver (in its own session) running
        children.stop()
        raise
    if failure is not None:
        click.echo(f"Error: {failure.child} failed {budget.recent} times within {budget.window_s:g} s; last: "
                   f"{failure.reason}\nstopping: the server cannot serve", err=True)  # fmt: skip
        children.kill()
        children.stop()
        return EXIT_UNSERVABLE
    children.cancel_standby_start()
    config = children.server.config
    click.echo(f"draining: new requests are refused; running ones have {config.drain_timeout_s:g} s", err=True)
    result = Supervisor(children.servers).drain(config.drain_timeout_s)
    children.stop()
    if children.crash_logs:
        logs = ", ".join(str(path) for path in children.crash_logs)
        click.echo(f"Error: the model's stub crashed (its Python stacks are in {logs})", err=True)
    if not result.clean:
        what = f"{result.cut} request(s)" if result.complete else "requests (the model stopped reporting)"
        click.echo(f"Error: the shutdown cut {what} at the drain deadline", err=True)
        return EXIT_CUT
    return EXIT_CRASHED if children.crashed_at_exit else 0


def _supervise(
    children: _Children,
    stop: threading.Event,
    budget: RestartBudget,
    errors: tuple[type[Exception], ...],
    health_interval_s: float,
    stall_s: float,
    failure: Failure | None = None,
) -> Failure | None:
    """Watch the children, restarting each that fails (`failure`: one that failed as the server started),
    until `stop` (None) or the budget is spent (the last failure)."""
    while True:
        if failure is None:
            supervisor = Supervisor(
                children.servers,
                probe_interval_s=health_interval_s,
                stall_s=stall_s,
                report=lambda message: click.echo(f"warning: {message}", err=True),
            )
            failure = supervisor.watch(stop, children.others())
        while failure is not None:
            seen = time.monotonic()
            delay = budget.delay(seen)
            if delay is None and failure.child == STANDBY:
                children.drop_standby(failure.reason)
                failure = None
                break
            if delay is None:
                return failure
            click.echo(f"Error: {failure.reason}\nrestarting {failure.child} in {delay:g} s", err=True)
            if stop.wait(delay):
                return None
            budget.record(time.monotonic())
            try:
                children.restart(failure.child)
            except errors as exc:
                failure = Failure(failure.child, f"restart failed: {exc}")
                continue
            click.echo(f"{failure.child} restarted: serving again {time.monotonic() - seen:.1f} s after the "
                       "failure was seen", err=True)  # fmt: skip
            children.announce()  # (once: the first time everything serves, if a child failed as the server started)
            failure = None
        if stop.is_set():
            return None


def _print_endpoints(children: _Children, served_name: str) -> None:
    config = children.server.config
    triton = f"{config.host}:{config.http_port}"
    click.echo(f"ready: model '{MODEL_NAME}'\n"
               f"  HTTP     http://{triton}/v2/models/{MODEL_NAME}/generate (and generate_stream)\n"
               f"  gRPC     {config.host}:{config.grpc_port}\n"
               f"  metrics  http://{config.host}:{config.metrics_port}/metrics")  # fmt: skip
    if (spare := children.standby_config) is not None:
        click.echo(
            f"  standby  gRPC {spare.host}:{spare.grpc_port}, HTTP {spare.host}:{spare.http_port} (a warm "
            "spare: the OpenAI gateway's while tritonserver cannot serve)"
        )
    if children.gateway is not None:
        click.echo(f"  OpenAI   {children.gateway.url}/v1 (model '{served_name}'; log: {children.gateway.log_path})")

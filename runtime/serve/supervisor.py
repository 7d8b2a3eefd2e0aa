"""`trtserve serve`'s watch over its tritonserver (and gateway): health probes, heartbeat, the graceful drain.

Triton keeps answering "ready" after the `llm` stub process dies (every request then fails with "Stub
process is not healthy", in-flight ones never end), so readiness cannot come from Triton: every
`probe_interval_s` the supervisor sends each tritonserver's model (the serving one, and a warm spare's) a
health probe through Triton's HTTP generate endpoint and reads the model's heartbeat
(engine_format/serving.py); runtime.serve.liveness tells a dead model from a busy one. `watch()` returns the
first child that cannot serve (a tritonserver, its model, or another child such as the gateway) and why; the
caller restarts it (runtime.serve.serve_loop). A reload
through Triton's model-control API was not chosen: unloading the dead model waits for its in-flight
requests, which a dead stub never finishes; a new tritonserver starts in seconds.

`drain()` is the shutdown: new requests are refused at once (by every tritonserver's model), running ones
go on until the drain deadline, the rest are cut with a final error; only then is Triton stopped, well
inside its own exit timeout, and its shared-memory regions removed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine_format.serving import (
    HEALTH_ANSWER,
    HEALTH_PARAMETER,
    MODEL_NAME,
    drain_state,
    read_heartbeat,
    request_drain,
)
from runtime.serve.launcher import TritonServer, process_stat
from runtime.serve.liveness import STUB_DEAD, Liveness

STOP_TIMEOUT_S = 15.0  # Triton's own shutdown once nothing is in flight
REPORT_GRACE_S = 10.0  # how long past the deadline the model may take to report its last request done
TRITON = "tritonserver"  # Failure.child for tritonserver and its model
STANDBY = "the standby tritonserver"  # Failure.child for the warm spare and its model


class Child(Protocol):
    """The gateway process (runtime.gateway.process.GatewayProcess), as far as supervision needs it."""

    def poll(self) -> int | None: ...


@dataclass(frozen=True)
class Failure:
    child: str  # TRITON, STANDBY, or the name of another child
    reason: str


@dataclass(frozen=True)
class DrainResult:
    cut: int  # requests answered with the shutdown error at the deadline
    complete: bool  # the model reported every request done (else Triton's stop cut what was left)

    @property
    def clean(self) -> bool:
        return self.complete and self.cut == 0


def stub_running(pid: int, model_dir: Path) -> bool:
    """Whether process `pid` is the stub of the model in `model_dir` and can run: not exited (a zombie has, and
    tritonserver has yet to reap it) nor stopped."""
    try:
        state = process_stat(pid)[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "T", "t") and f"{model_dir}/" in command


class Supervisor:
    def __init__(self, servers: Mapping[str, TritonServer], probe_interval_s: float = 2.0, probe_timeout_s: float = 5.0,
                 max_failures: int = 3, stall_s: float = 60.0, clock: Callable[[], float] = time.time,
                 report: Callable[[str], None] = lambda message: None) -> None:  # fmt: skip
        """`servers`: the tritonservers by child name (TRITON, STANDBY); `stall_s`: how long a model may show no
        progress with work unfinished (runtime.serve.liveness); `report`: told when probes fail but a model is
        busy, not dead (once per episode)."""
        self.servers = servers
        self.probe_interval_s, self.probe_timeout_s = probe_interval_s, probe_timeout_s
        self.max_failures, self.stall_s, self.clock, self.report = max_failures, stall_s, clock, report

    def probe(self, server: TritonServer) -> str | None:
        """None when `server`'s model answered the health probe, else what went wrong."""
        url = f"{server.config.http_url}/v2/models/{MODEL_NAME}/generate"
        body = json.dumps({"parameters": {HEALTH_PARAMETER: True}}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.probe_timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            return f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
        except (OSError, ValueError) as exc:  # refused, timed out, cut, not JSON
            return f"{type(exc).__name__}: {exc}"
        return None if answer.get("text_output") == HEALTH_ANSWER else f"unexpected answer {answer!r}"

    def watch(self, stop: threading.Event, others: Mapping[str, Child] | None = None) -> Failure | None:
        """Until `stop` is set (None) or a child cannot serve: a tritonserver or another child (`others`:
        name -> process) exited, or a model is dead (runtime.serve.liveness)."""
        liveness: dict[str, Liveness] = {}
        reported: dict[str, str] = {}
        while not stop.wait(self.probe_interval_s):
            servers = list(self.servers.items())  # a warm spare joins once it is ready (another thread adds it)
            for name, server in servers:
                if (code := server.process.poll()) is not None:
                    return Failure(name, f"{name} exited (code {code}):\n{server.log_tail()}")
            for name, child in (others or {}).items():
                if (code := child.poll()) is not None:
                    return Failure(name, f"{name} exited (code {code})")
            for name, server in servers:
                watched = liveness.setdefault(name, Liveness(self.max_failures, self.stall_s))
                problem, heartbeat = self.probe(server), read_heartbeat(server.model_dir)
                pid = heartbeat.pid if heartbeat is not None else None
                # The stub's process is looked up only for the answer it decides.
                running = STUB_DEAD in (problem or "") and pid is not None and stub_running(pid, server.model_dir)
                verdict = watched.observe(problem, heartbeat, self.clock(), running)
                if verdict.dead and not stop.is_set():
                    return Failure(name, verdict.reason)
                if verdict.reason and not reported.get(name):
                    self.report(verdict.reason if name == TRITON else f"{name}: {verdict.reason}")
                reported[name] = verdict.reason
        return None

    def drain(self, timeout_s: float) -> DrainResult:
        """Refuse new requests, let running ones go on for `timeout_s`, cut the rest; returns once every
        model reports nothing in flight (or one stopped reporting, or its tritonserver died)."""
        deadline = time.time() + timeout_s
        for server in self.servers.values():
            request_drain(server.model_dir, deadline)
        give_up = time.monotonic() + timeout_s + REPORT_GRACE_S
        states: dict[str, dict[str, int] | None] = dict.fromkeys(self.servers)
        while time.monotonic() < give_up:
            running = {name: s for name, s in self.servers.items() if s.process.poll() is None}
            states.update({name: drain_state(server.model_dir) for name, server in running.items()})
            if len(running) < len(self.servers):  # a tritonserver died: its requests were cut with it
                break
            if all(state is not None and state["in_flight"] == 0 for state in states.values()):
                return DrainResult(sum(state["cut"] for state in states.values() if state), complete=True)
            time.sleep(0.1)
        return DrainResult(sum(state["cut"] for state in states.values() if state), complete=False)

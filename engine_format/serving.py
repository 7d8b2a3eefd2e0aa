"""The served model's protocol with the processes around it: its name, outputs' meaning aside (requests.py),
the health probe, and the files through which `trtserve serve` drains it and reads its heartbeat.

- Health: a request carrying the parameter HEALTH_PARAMETER (`{"trtserve_health": true}` on the HTTP
  generate endpoint, or as a gRPC request parameter) is answered by the model's event loop after checking
  that its engine loop runs, without queueing behind generations. It travels the whole path a request does
  (Triton, the stub's IPC, the loop), so a dead stub fails it although Triton keeps answering "ready".
- Drain: the supervisor writes DRAIN_FILE (`{"deadline": <unix time>}`) into the model's directory. The
  model refuses new requests (REFUSED_MESSAGE), lets running ones go on until the deadline, then cuts the
  rest with CUT_MESSAGE, and writes STATE_FILE (`{"in_flight": n, "cut": k}`) as it goes, so the supervisor
  knows when Triton may stop and whether anything was cut. Both messages start with DRAINING: a gateway
  answers 503 at once (retried on another replica while nothing was streamed), without waiting for this one.
- Heartbeat: every POLL_S the model writes HEARTBEAT_FILE (Heartbeat): the time, its engine's step count
  and unfinished requests, why the engine loop stopped (if it did), when its event loop last ran a callback.
  The supervisor tells a dead or wedged model from a busy one with it (runtime.serve.liveness).
Files, because the stub is Triton's child: no channel of ours reaches it. Writes are atomic (temp + rename).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MODEL_NAME = "llm"
HEALTH_PARAMETER = "trtserve_health"
HEALTH_ANSWER = "ok"  # the probe's text_output when the model can serve
DRAIN_FILE = "drain.json"
STATE_FILE = "drain-state.json"
HEARTBEAT_FILE = "heartbeat.json"
POLL_S = 0.2
DRAINING = "server shutting down"
REFUSED_MESSAGE = f"{DRAINING}: model '{MODEL_NAME}' is not ready for new requests"
CUT_MESSAGE = f"{DRAINING}: the drain deadline passed before this request finished (model is not ready)"
ENGINE_STOPPED = "engine loop stopped"  # the model's health answer once its engine loop died: it cannot serve


@dataclass(frozen=True)
class Heartbeat:
    """One HEARTBEAT_FILE: the engine's progress, when it was written and when the model's event loop last
    ran a callback (time.time() seconds)."""

    time: float
    loop_tick: float
    steps: int
    unfinished: int
    problem: str | None = None  # why the engine loop stopped (starts with ENGINE_STOPPED)
    pid: int | None = None  # the stub's process (Triton's "stub is not healthy" can be a missed check)


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Atomically (write + rename): a reader never sees half a file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text(json.dumps(value))
    temp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_heartbeat(model_dir: Path, heartbeat: Heartbeat) -> None:
    write_json(model_dir / HEARTBEAT_FILE, asdict(heartbeat))


def read_heartbeat(model_dir: Path) -> Heartbeat | None:
    """The model's last heartbeat, or None before its first (or a malformed one)."""
    value = read_json(model_dir / HEARTBEAT_FILE)
    if value is None:
        return None
    try:
        pid = value.get("pid")
        return Heartbeat(
            float(value["time"]),
            float(value["loop_tick"]),
            int(value["steps"]),
            int(value["unfinished"]),
            value.get("problem"),
            int(pid) if pid is not None else None,
        )
    except (KeyError, TypeError, ValueError):
        return None


def request_drain(model_dir: Path, deadline: float) -> None:
    """Ask the model to drain until `deadline` (time.time() seconds)."""
    write_json(model_dir / DRAIN_FILE, {"deadline": deadline})


def drain_deadline(model_dir: Path) -> float | None:
    """The drain's deadline the supervisor asked for, or None (serving)."""
    request = read_json(model_dir / DRAIN_FILE)
    if request is None:
        return None
    try:
        return float(request.get("deadline", 0))
    except (TypeError, ValueError):
        return 0.0  # a malformed request still drains: at once


def report_drain(model_dir: Path, in_flight: int, cut: int) -> None:
    write_json(model_dir / STATE_FILE, {"in_flight": in_flight, "cut": cut})


def drain_state(model_dir: Path) -> dict[str, int] | None:
    """The model's last drain report, or None before it saw the drain request."""
    state = read_json(model_dir / STATE_FILE)
    if state is None or not all(isinstance(state.get(k), int) for k in ("in_flight", "cut")):
        return None
    return {"in_flight": state["in_flight"], "cut": state["cut"]}

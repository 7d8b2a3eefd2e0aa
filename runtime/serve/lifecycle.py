"""Health probes and the graceful drain, between `trtserve serve` (runtime.serve.supervisor) and the
`llm` model (model_repository/llm/1/model.py, inside the Python-backend stub).

- Health: a request carrying the parameter HEALTH_PARAMETER (`{"trtserve_health": true}` on the
  HTTP generate endpoint) is answered by the model's asyncio loop after checking that its engine loop
  runs, without queueing behind generations. It travels the whole path a request does (Triton, the
  stub's IPC, the loop), so a dead stub fails it although Triton keeps answering "ready".
- Drain: the supervisor writes DRAIN_FILE (`{"deadline": <unix time>}`) into the model's directory.
  The model, polling every POLL_S, refuses new requests (REFUSED_MESSAGE), lets running ones go on
  until the deadline, then cuts the rest with CUT_MESSAGE, and writes STATE_FILE
  (`{"in_flight": n, "cut": k}`) on every poll, so the supervisor knows when Triton may stop and
  whether anything was cut. Files, because the stub is Triton's child: no channel of ours reaches it.
  Both messages say "is not ready", which the gateway maps to 503 (retried on another replica while
  nothing was streamed).
- Heartbeat: on the same thread, every POLL_S, the model writes HEARTBEAT_FILE: the time, its engine's
  step count and unfinished requests, why the engine loop stopped (if it did), and when the model's
  event loop last ran a callback. The supervisor tells a dead or wedged model (no heartbeat, a stopped
  engine or event loop, unfinished work with no step) from a busy one whose probes wait behind work
  (runtime.serve.liveness).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Sized
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.engine.stats import EngineProgress

DRAIN_FILE = "drain.json"
STATE_FILE = "drain-state.json"
HEARTBEAT_FILE = "heartbeat.json"
HEALTH_PARAMETER = "trtserve_health"
POLL_S = 0.2
REFUSED_MESSAGE = "server shutting down: model 'llm' is not ready for new requests"
CUT_MESSAGE = "server shutting down: the drain deadline passed before this request finished (model is not ready)"


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Atomically (write + rename): a reader never sees half a file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text(json.dumps(value))
    temp.replace(path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def request_drain(model_dir: Path, deadline: float) -> None:
    """Supervisor side: ask the model to drain until `deadline` (time.time() seconds)."""
    _write_json(model_dir / DRAIN_FILE, {"deadline": deadline})


def drain_state(model_dir: Path) -> dict[str, int] | None:
    """Supervisor side: the model's last report, or None before it saw the drain request."""
    state = _read_json(model_dir / STATE_FILE)
    if state is None or not all(isinstance(state.get(k), int) for k in ("in_flight", "cut")):
        return None
    return {"in_flight": state["in_flight"], "cut": state["cut"]}


@dataclass(frozen=True)
class Heartbeat:
    """One HEARTBEAT_FILE: the engine's progress (AsyncLLM.progress()), when it was written and when the
    model's event loop last ran a callback (time.time() seconds)."""

    time: float
    loop_tick: float
    steps: int
    unfinished: int
    problem: str | None = None


def read_heartbeat(model_dir: Path) -> Heartbeat | None:
    """Supervisor side: the model's last heartbeat, or None before its first (or a malformed one)."""
    value = _read_json(model_dir / HEARTBEAT_FILE)
    if value is None:
        return None
    try:
        return Heartbeat(float(value["time"]), float(value["loop_tick"]), int(value["steps"]),
                         int(value["unfinished"]), value.get("problem"))  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None


def is_health_probe(request: Any) -> bool:
    """Model side: does this pb_utils.InferenceRequest carry the health parameter?"""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return HEALTH_PARAMETER in json.loads(request.parameters() or "{}")
    return False


class ModelLifecycle:
    """Model side, on its own thread: writes the heartbeat and watches for the drain request;
    `requested` tells execute() to refuse new requests; at the deadline every task on `loop` (the
    requests being served) is cancelled, and the model's handler answers CUT_MESSAGE and calls
    `count_cut()`."""

    def __init__(self, model_dir: Path, loop: asyncio.AbstractEventLoop, in_flight: Sized,
                 progress: Callable[[], EngineProgress]) -> None:  # fmt: skip
        self.model_dir, self.loop, self.in_flight, self.progress = model_dir, loop, in_flight, progress
        self.requested = threading.Event()
        self.cut = 0
        self.loop_tick = time.time()
        self._cancelled: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trtserve-lifecycle", daemon=True)
        self._thread.start()

    def count_cut(self) -> None:  # on the loop thread
        self.cut += 1

    def stop(self) -> None:
        """Stop the thread and wait for it: nothing of it may run once the model is finalized."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _tick(self) -> None:  # on the loop thread
        self.loop_tick = time.time()

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            self._beat()
            request = _read_json(self.model_dir / DRAIN_FILE)
            if request is None:
                continue
            self.requested.set()
            if time.time() >= float(request.get("deadline", 0)):
                self.loop.call_soon_threadsafe(self._cut_all)
            # After the cut is scheduled: a report of 0 in flight always comes after the cut answers.
            _write_json(self.model_dir / STATE_FILE, {"in_flight": len(self.in_flight), "cut": self.cut})

    def _beat(self) -> None:
        progress = self.progress()
        _write_json(self.model_dir / HEARTBEAT_FILE, asdict(Heartbeat(time.time(), self.loop_tick, **asdict(progress))))
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._tick)

    def _cut_all(self) -> None:
        for task in asyncio.all_tasks(self.loop) - set(self._cancelled):
            self._cancelled.add(task)  # each once: a task answering its cut is left to finish
            task.cancel()

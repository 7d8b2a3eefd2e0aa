"""The model's side of its protocol with `trtserve serve` (engine_format/serving.py): on a thread of its own,
the heartbeat and the drain."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any

from engine_format.serving import HEALTH_PARAMETER, POLL_S, Heartbeat, drain_deadline, report_drain, write_heartbeat
from runtime.engine.stats import EngineProgress


class ModelLifecycle:
    """Every POLL_S: writes the heartbeat and looks for the drain request; `requested` tells execute() to
    refuse new requests; at the deadline every task on `loop` (the requests being served) is cancelled,
    and the model's handler answers CUT_MESSAGE and calls `count_cut()`. Once a drain has nothing left in
    flight, garbage is collected: tritonserver unloads a decoupled model only after every response sender is
    deleted, and a sender left in a reference cycle (a finished coroutine's frame, a traceback) is deleted only
    by a collection, which an idle process may not run for a long time (the unload outlasted serve's 15 s)."""

    def __init__(self, model_dir: Path, loop: asyncio.AbstractEventLoop, in_flight: Sized,
                 progress: Callable[[], EngineProgress]) -> None:  # fmt: skip
        self.model_dir, self.loop, self.in_flight, self.progress = model_dir, loop, in_flight, progress
        self.requested = threading.Event()
        self.cut = 0
        self.loop_tick = time.time()
        self.pid = os.getpid()  # the stub's, in each heartbeat
        self._cancelled: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self._stopping = threading.Event()
        self._collected = False  # once per drain, when nothing is left in flight
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
            deadline = drain_deadline(self.model_dir)
            if deadline is None:
                continue
            self.requested.set()
            if time.time() >= deadline:
                self.loop.call_soon_threadsafe(self._cut_all)
            # After the cut is scheduled: a report of 0 in flight always comes after the cut answers.
            in_flight = len(self.in_flight)
            if in_flight == 0 and not self._collected:
                gc.collect()
                self._collected = True
            report_drain(self.model_dir, in_flight, self.cut)

    def _beat(self) -> None:
        progress = self.progress()
        beat = Heartbeat(time.time(), self.loop_tick, progress.steps, progress.unfinished, progress.problem, self.pid)
        write_heartbeat(self.model_dir, beat)
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._tick)

    def _cut_all(self) -> None:
        for task in asyncio.all_tasks(self.loop) - set(self._cancelled):
            self._cancelled.add(task)  # each once: a task answering its cut is left to finish
            task.cancel()


def is_health_probe(request: Any) -> bool:
    """Does this pb_utils.InferenceRequest carry the health parameter?"""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return HEALTH_PARAMETER in json.loads(request.parameters() or "{}")
    return False

"""What benchmarks.served_path records at each engine step, in whichever process the core runs: the simulated
device with its calls timed (the backend's host work apart from its waits for the device), and a mark per step.
A module of its own so that the engine core's process can import `recording_device` by name."""

from __future__ import annotations

import atexit
import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import overlap
from benchmarks.overlap import SimulatedDevice
from engine_format import EngineConfig

PROMPT_TOKENS = 200


class Timer:
    """Adds up the seconds spent in wrapped callables, per name (any thread; each name runs on one)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def wrap(self, name: str, method):
        self.seconds.setdefault(name, 0.0)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[name] += time.perf_counter() - start

        return timed

    def excluding(self, name: str, excluded: str, method):
        """`wrap`, less the time `excluded` gained meanwhile (a backend's call, less its wait for the device)."""

        def timed(*args, **kwargs):
            start, before = time.perf_counter(), self.snapshot().get(excluded, 0.0)
            try:
                return method(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start - (self.snapshot().get(excluded, 0.0) - before))

        return timed

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.seconds)


@dataclass(frozen=True)
class Mark:
    """The state after one engine step."""

    time: float
    prompt_tokens: int  # computed so far
    busy: float  # the simulated device's busy seconds queued so far
    free_at: float  # when it finishes what is queued
    seconds: dict[str, float]  # the timer's parts so far
    cpu: dict[str, float]  # each thread's CPU seconds so far


WAIT_UNTIL = overlap._wait_until


def timed_device(config: EngineConfig, blocks: int, device_s: float) -> tuple[SimulatedDevice, Timer]:
    """The simulated device, its calls timed: the backend's host work, and its waits for the device (a CUDA
    event's synchronize on a GPU: device time, not host work)."""
    device = SimulatedDevice(config, blocks, device_s)
    timer = Timer()
    for name in ("step_sample", "launch"):
        setattr(device, name, timer.excluding("backend", "device_wait", getattr(device, name)))
    overlap._wait_until = timer.wrap("device_wait", WAIT_UNTIL)
    return device, timer


def recording_device(
    config: EngineConfig, blocks: int, device_s: float, marks_path: Path, prompt_tokens: int = PROMPT_TOKENS
) -> SimulatedDevice:
    """In the engine core's process: the timed device, a mark at each launch (the core steps nothing else),
    written to `marks_path` as the process exits. `prompt_tokens`: each prompt's length (the marks count
    the prompt tokens computed so far, as the engine's counters do)."""
    device, timer = timed_device(config, blocks, device_s)
    marks: list[Mark] = []
    computed = 0
    timed_launch = device.launch

    def launch(chunks, *args):
        nonlocal computed
        computed += sum(max(0, min(c.past_len + len(c.token_ids), prompt_tokens) - c.past_len) for c in chunks)
        pending = timed_launch(chunks, *args)
        seconds = timer.snapshot()
        marks.append(
            Mark(
                time.perf_counter(),
                computed,
                device.device_busy_s,
                device.free_at,
                seconds,
                {"engine": time.thread_time()},
            )
        )
        return pending

    device.launch = launch  # type: ignore[method-assign]
    atexit.register(lambda: marks_path.write_bytes(pickle.dumps(marks)))
    return device

"""`python -m benchmarks.served_path`: the served engine's host work per step, timed whole, without a GPU.

AsyncLLM as the Triton model runs it: the engine thread steps the core, the output thread turns tokens into
text (detokenization, stop strings) and hands each stream its deltas, and the event loop builds each
response's arrays (runtime/triton_model/responses.py, what the model sends); the heap made at start is frozen
out of the garbage collector's passes, as the model freezes it (runtime/triton_model/heap.py). B streaming
requests decode together (200-token prompts of random text tokens, temperature 0.7 / top-p 0.9, one stop
string, EOS ignored) over a simulated device (benchmarks/overlap.py's SimulatedDevice: no work, but each step
occupies one device stream for D ms, and its tokens are read once it has finished). Over the steady steps:

- host µs per step by part: the engine thread's core (its step less the backend's calls and the waits for
  the device), the backend's calls (less their waits), the output thread (text), the event loop (deltas to
  streams and response arrays); and the engine thread's wait for the device, which is not host work;
- the device's busy share (its busy time over the window: 1.0 when the host hides behind the device);
- the step interval's median and p99 (from the engine's step records);
- each thread's CPU time per step (its POSIX CPU clock: work done, whatever the GIL made it wait for, which
  the wall-time parts above include): the engine thread, the output thread and the event loop's thread.

    python -m benchmarks.served_path [--batches 1,64,256] [--device-ms 1.5,2] [--steps 64]
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from benchmarks import overlap
from benchmarks.host_overhead import engine_with_batch
from benchmarks.host_step_ab import decode_run_sizes
from benchmarks.overlap import SimulatedDevice
from benchmarks.report import write_report
from engine_format import EngineConfig
from executors.sampling import SamplingParams
from runtime.async_llm import AsyncLLM
from runtime.engine.engine_args import EngineArgs
from runtime.triton_model.heap import freeze_startup_heap
from runtime.triton_model.responses import output_arrays

PROMPT_TOKENS = 200
WANTED = ("text_output", "finish_reason", "prompt_tokens", "completion_tokens")  # what a Triton client asks


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


def measure(engine_dir: Path, batch: int, device_ms: float, steps: int, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """One served run: B streams, `steps` steady steps timed after a warm-up."""
    config = EngineConfig.load(engine_dir)
    max_tokens, blocks, engine_args = decode_run_sizes(batch, steps, prompt_tokens, config.block_size)
    device = SimulatedDevice(config, blocks, device_ms / 1e3)
    waiting = overlap._wait_until
    timer = Timer()
    for name in ("step_sample", "launch"):
        setattr(device, name, timer.excluding("backend", "device_wait", getattr(device, name)))
    # The simulated device's waits (a CUDA event's synchronize on a GPU): device time, not host work.
    overlap._wait_until = timer.wrap("device_wait", overlap._wait_until)
    args = EngineArgs(**engine_args)
    llm = AsyncLLM(engine_dir, args, backend=device)
    freeze_startup_heap("benchmarks.served_path")  # as the Triton model does once its engine is up
    engine = llm.engine
    timed_step = timer.wrap("engine_thread", engine.step_tokens)
    engine.outputs.process = timer.wrap("output_thread", engine.outputs.process)  # type: ignore[method-assign]
    clocks = {
        "engine": time.pthread_getcpuclockid(llm._thread.ident),
        "outputs": time.pthread_getcpuclockid(llm._output_thread.ident),
        "event_loop": time.pthread_getcpuclockid(threading.get_ident()),
    }
    marks: list[Mark] = []  # one per engine step, taken on the engine thread (the event loop may lag behind)

    def step_tokens():
        out = timed_step()
        marks.append(
            Mark(
                time.perf_counter(),
                engine.counters.prompt_tokens,
                device.device_busy_s,
                device.free_at,
                timer.snapshot(),
                {name: time.clock_gettime(clock) for name, clock in clocks.items()},
            )
        )
        return out

    engine.step_tokens = step_tokens  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, stop=("\n\n\n\n\n",), ignore_eos=True)

    async def stream(prompt: list[int]) -> None:
        async for delta in llm.generate(prompt, params):
            start = time.perf_counter()
            output_arrays(WANTED, delta.text, delta)
            timer.add("event_loop", time.perf_counter() - start)

    async def main() -> None:
        prompts = [rng.integers(17, config.model.vocab_size, prompt_tokens).tolist() for _ in range(batch)]
        await asyncio.gather(*(stream(p) for p in prompts))

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
        overlap._wait_until = waiting
        gc.unfreeze()
    # The window: from a few steps after every prompt was computed (all B decoding), `steps` steps.
    decoding = next(i for i, m in enumerate(marks) if m.prompt_tokens >= batch * prompt_tokens)
    first, last = marks[decoding + 4], marks[decoding + 4 + steps]
    span = last.time - first.time
    carried_in = max(0.0, first.free_at - first.time)
    busy = last.busy - first.busy + carried_in - max(0.0, last.free_at - last.time)
    timed = marks[decoding + 4 : decoding + 5 + steps]
    intervals = sorted(b.time - a.time for a, b in itertools.pairwise(timed))

    def per_step_us(name: str) -> float:
        return round((last.seconds.get(name, 0.0) - first.seconds.get(name, 0.0)) / steps * 1e6, 1)

    backend_us, wait_us = per_step_us("backend"), per_step_us("device_wait")
    return {
        "batch": batch,
        "device_ms": device_ms,
        "steps": steps,
        "step_ms": round(span / steps * 1e3, 3),
        "engine_core_us": round(per_step_us("engine_thread") - backend_us - wait_us, 1),
        "backend_us": backend_us,
        "output_thread_us": per_step_us("output_thread"),
        "event_loop_us": per_step_us("event_loop"),
        "device_wait_us": wait_us,
        "device_busy": round(min(1.0, busy / span), 3),
        "step_interval_p50_ms": round(statistics.median(intervals) * 1e3, 3),
        "step_interval_p99_ms": round(intervals[int(0.99 * (len(intervals) - 1))] * 1e3, 3),
        "cpu_us": {name: round((last.cpu[name] - first.cpu[name]) / steps * 1e6, 1) for name in clocks},
    }


@dataclass(frozen=True)
class Mark:
    """The state after one engine step."""

    time: float
    prompt_tokens: int  # computed so far
    busy: float  # the simulated device's busy seconds queued so far
    free_at: float  # when it finishes what is queued
    seconds: dict[str, float]  # the timer's parts so far
    cpu: dict[str, float]  # each thread's CPU seconds so far


@click.command()
@click.option("--batches", default="1,64,256", show_default=True)
@click.option("--device-ms", default="1.5,2", show_default=True, help="Simulated device time per step, ms.")
@click.option("--steps", default=64, show_default=True, type=click.IntRange(8))
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="An engine whose max batch size covers the largest batch (default: the tiny model, built).",
)
@click.option("--output", default="served_path", show_default=True, help="Report name under benchmarks/results/.")
def main(batches: str, device_ms: str, steps: int, engine_dir: Path | None, output: str) -> None:
    sizes, devices = [int(b) for b in batches.split(",")], [float(d) for d in device_ms.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = engine_dir or engine_with_batch(max(sizes), Path(tmp))
        for batch in sizes:
            for device in devices:
                rows.append(measure(engine_dir, batch, device, steps))
                r = rows[-1]
                click.echo(
                    f"batch {batch:4d}, device {device} ms: {r['step_ms']} ms a step, device busy "
                    f"{r['device_busy']:.0%}; host µs a step: core {r['engine_core_us']}, text "
                    f"{r['output_thread_us']}, event loop {r['event_loop_us']}; CPU µs a step by thread {r['cpu_us']}"
                )
    command = f"python -m benchmarks.served_path --batches {batches} --device-ms {device_ms} --steps {steps}"
    write_report(output, {"command": command, "engine": str(engine_dir), "rows": rows}, render)


def render(payload: dict) -> str:
    lines = [
        "# The served path's host work per step, over a simulated device (no GPU)",
        "",
        f"Machine: {payload.get('machine', '?')}",
        "",
        f"Command: `{payload['command']}`",
        "",
        "AsyncLLM as served (engine thread, output thread, event loop building the Triton model's response "
        "arrays), B streams of random text tokens, temperature 0.7 / top-p 0.9, one stop string, over a device "
        "that takes D ms a step. Host µs per step by part (the engine thread's wait for the device apart), "
        "the device's busy share, and the interval between steps. Wall-time parts include each thread's waits "
        "for the GIL; the CPU columns (each thread's CPU clock) do not: they are the work itself.",
        "",
        "| batch | device ms | ms / step | device busy | core µs | backend µs | output thread µs | "
        "event loop µs | device wait µs | step p50 ms | step p99 ms | CPU µs: engine / outputs / event loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['device_ms']} | {r['step_ms']} | {r['device_busy']:.0%} | {r['engine_core_us']} | "
        f"{r['backend_us']} | {r['output_thread_us']} | {r['event_loop_us']} | {r['device_wait_us']} | "
        f"{r['step_interval_p50_ms']} | {r['step_interval_p99_ms']} | {_cpu(r)} |"
        for r in payload["rows"]
    ]
    return "\n".join(lines) + "\n"


def _cpu(row: dict) -> str:
    cpu = row.get("cpu_us")  # (reports before the column have none)
    return "" if cpu is None else f"{cpu['engine']} / {cpu['outputs']} / {cpu['event_loop']}"


if __name__ == "__main__":
    main()

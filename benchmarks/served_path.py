"""`python -m benchmarks.served_path`: the served engine's host work per step, timed whole, without a GPU.

AsyncLLM as the Triton model runs it: the engine core steps (on a thread of this process, or in a process of
its own: `--modes`, the simulated device then runs there and records its marks, benchmarks/step_marks.py), the
output thread turns tokens into text (detokenization, stop strings) and hands each stream its deltas, and the
event loop builds each response's arrays (runtime/triton_model/responses.py, what the model sends); the heap
made at start is frozen
out of the garbage collector's passes, as the model freezes it (runtime/engine/heap.py). B streaming
requests decode together (200-token prompts of random text tokens, temperature 0.7 / top-p 0.9, one stop
string, EOS ignored) over a simulated device (benchmarks/overlap.py's SimulatedDevice: no work, but each step
occupies one device stream for D ms, and its tokens are read once it has finished). Over the steady steps:

- host µs per step by part: the engine thread's core (its step less the backend's calls and the waits for
  the device), the backend's calls (less their waits), the output thread (text), the event loop (deltas to
  streams and response arrays); and the engine thread's wait for the device, which is not host work;
- the device's busy share (its busy time over the window: 1.0 when the host hides behind the device);
- the step interval's median and p99 (between the engine's steps);
- each thread's CPU time per step (its POSIX CPU clock: work done, whatever the GIL made it wait for, which
  the wall-time parts above include): the engine thread, the output thread and the event loop's thread.

With the core in its own process, its steps never wait for the front end: one that falls behind receives the
steps since its last message merged (runtime/engine/core_outbox.py), so the text and event-loop parts per step
shrink as it falls behind. With the core on a thread, the engine runs ahead of an unbounded queue.

    python -m benchmarks.served_path [--batches 1,64,256] [--device-ms 1.5,2] [--steps 64]
                                     [--modes thread,process] [--rounds 3] [--baseline COMMIT]

`--baseline COMMIT`: every run twice, over that commit's code (its files exported) and this one's, alternating
which goes first; each run in a process of its own, this harness over the code of the tree it imports.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import numpy as np

from benchmarks import overlap
from benchmarks.host_overhead import engine_with_batch
from benchmarks.host_step_ab import decode_run_sizes
from benchmarks.overlap import SimulatedDevice
from benchmarks.report import write_report
from benchmarks.step_marks import PROMPT_TOKENS, WAIT_UNTIL, Mark, Timer, recording_device, timed_device
from engine_format import EngineConfig
from executors.sampling import SamplingParams
from runtime.async_llm import AsyncLLM
from runtime.engine.engine_args import EngineArgs
from runtime.engine.heap import freeze_startup_heap
from runtime.triton_model.responses import output_arrays

HERE = Path(__file__).resolve().parent.parent  # this code's tree (`--baseline` runs another's beside it)
WANTED = ("text_output", "finish_reason", "prompt_tokens", "completion_tokens")  # what a Triton client asks


def measure(
    engine_dir: Path,
    batch: int,
    device_ms: float,
    steps: int,
    engine_process: bool = False,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict:
    """One served run: B streams, `steps` steady steps timed after a warm-up; `engine_process`: the engine core
    in a process of its own (EngineArgs.engine_process), the device simulated there."""
    config = EngineConfig.load(engine_dir)
    max_tokens, blocks, engine_args = decode_run_sizes(batch, steps, prompt_tokens, config.block_size)
    args = EngineArgs(**engine_args, engine_process=engine_process)
    front = Timer()  # this process's parts: the output thread's text, the event loop's responses
    with tempfile.TemporaryDirectory() as tmp:
        core_marks = Path(tmp) / "core_marks.pkl"
        if engine_process:
            factory = functools.partial(
                recording_device,
                blocks=blocks,
                device_s=device_ms / 1e3,
                marks_path=core_marks,
                prompt_tokens=prompt_tokens,
            )
            llm = AsyncLLM(engine_dir, args, backend_factory=factory)
        else:
            device, timer = timed_device(config, blocks, device_ms / 1e3)
            llm = AsyncLLM(engine_dir, args, backend=device)
        freeze_startup_heap("benchmarks.served_path")  # as the Triton model does once its engine is up
        llm.outputs.process = front.wrap("output_thread", llm.outputs.process)  # type: ignore[method-assign]
        clocks = {
            "outputs": time.pthread_getcpuclockid(llm._output_thread.ident),
            "event_loop": time.pthread_getcpuclockid(threading.get_ident()),
        }
        if not engine_process:
            clocks["engine"] = time.pthread_getcpuclockid(llm._thread.ident)
            marks = mark_each_step(llm.engine, device, timer, front, clocks)
        else:
            front_marks = mark_each_call(llm.outputs, front, clocks)
        rng = np.random.default_rng(0)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.7, top_p=0.9, stop=("\n\n\n\n\n",), ignore_eos=True
        )

        async def stream(prompt: list[int]) -> None:
            async for delta in llm.generate(prompt, params):
                start = time.perf_counter()
                output_arrays(WANTED, delta.text, delta)
                front.add("event_loop", time.perf_counter() - start)

        async def main() -> None:
            prompts = [rng.integers(17, config.model.vocab_size, prompt_tokens).tolist() for _ in range(batch)]
            await asyncio.gather(*(stream(p) for p in prompts))

        try:
            asyncio.run(main())
        finally:
            llm.shutdown()
            gc.unfreeze()
            if not engine_process:
                overlap._wait_until = WAIT_UNTIL
        if engine_process:  # the core's marks (its process wrote them as it exited), this process's merged in
            marks = merged(pickle.loads(core_marks.read_bytes()), front_marks)
    return summarize(marks, batch, device_ms, steps, engine_process, prompt_tokens)


def mark_each_step(engine, device: SimulatedDevice, timer: Timer, front: Timer, clocks: dict[str, int]) -> list[Mark]:
    """In one process: a mark after each engine step, taken on the engine thread (the event loop may lag)."""
    marks: list[Mark] = []
    timed_step = timer.wrap("engine_thread", engine.step_tokens)

    def step_tokens():
        out = timed_step()
        seconds = {**timer.snapshot(), **front.snapshot()}
        cpu = {name: time.clock_gettime(clock) for name, clock in clocks.items()}
        marks.append(
            Mark(time.perf_counter(), engine.counters.prompt_tokens, device.device_busy_s, device.free_at, seconds, cpu)
        )
        return out

    engine.step_tokens = step_tokens
    return marks


def mark_each_call(outputs, front: Timer, clocks: dict[str, int]) -> list[tuple[float, dict, dict]]:
    """With the core in its own process: this process's timer and CPU clocks after each step's text."""
    marks: list[tuple[float, dict, dict]] = []
    process = outputs.process

    def timed(step_outputs):
        done = process(step_outputs)
        cpu = {name: time.clock_gettime(clock) for name, clock in clocks.items()}
        marks.append((time.perf_counter(), front.snapshot(), cpu))
        return done

    outputs.process = timed
    return marks


def merged(core: list[Mark], front: list[tuple[float, dict, dict]]) -> list[Mark]:
    """Each core mark with this process's timer and clocks as of the last step's text received before it."""
    out, i, last = [], 0, (0.0, {}, {})
    for mark in core:
        while i < len(front) and front[i][0] <= mark.time:
            last, i = front[i], i + 1
        out.append(
            Mark(
                mark.time,
                mark.prompt_tokens,
                mark.busy,
                mark.free_at,
                {**mark.seconds, **last[1]},
                {**mark.cpu, **last[2]},
            )
        )
    return out


def summarize(
    marks: list[Mark], batch: int, device_ms: float, steps: int, engine_process: bool, prompt_tokens: int
) -> dict:
    """The window: from a few steps after every prompt was computed (all B decoding), `steps` steps."""
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
    # The engine thread does nothing but step: in its own process, its wall time is the step's.
    engine_us = span / steps * 1e6 if engine_process else per_step_us("engine_thread")
    return {
        "batch": batch,
        "device_ms": device_ms,
        "engine_process": engine_process,
        "steps": steps,
        "step_ms": round(span / steps * 1e3, 3),
        "engine_core_us": round(engine_us - backend_us - wait_us, 1),
        "backend_us": backend_us,
        "output_thread_us": per_step_us("output_thread"),
        "event_loop_us": per_step_us("event_loop"),
        "device_wait_us": wait_us,
        "device_busy": round(min(1.0, busy / span), 3),
        "step_interval_p50_ms": round(statistics.median(intervals) * 1e3, 3),
        "step_interval_p99_ms": round(intervals[int(0.99 * (len(intervals) - 1))] * 1e3, 3),
        "cpu_us": {name: round((last.cpu[name] - first.cpu.get(name, 0.0)) / steps * 1e6, 1) for name in last.cpu},
    }


MODES = {"thread": False, "process": True}  # where the engine core runs: a thread of this process, or its own


@click.command()
@click.option("--batches", default="1,64,256", show_default=True)
@click.option("--device-ms", default="1.5,2", show_default=True, help="Simulated device time per step, ms.")
@click.option("--steps", default=64, show_default=True, type=click.IntRange(8))
@click.option(
    "--modes",
    default="thread,process",
    show_default=True,
    help="Where the engine core runs: a thread of the serving process, or a process of its own.",
)
@click.option(
    "--rounds",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Rounds of every mode, alternating which goes first.",
)
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="An engine whose max batch size covers the largest batch (default: the tiny model, built).",
)
@click.option("--baseline", default=None, help="A commit whose code runs every measurement too, alternating.")
@click.option("--output", default="served_path", show_default=True, help="Report name under benchmarks/results/.")
def main(
    batches: str,
    device_ms: str,
    steps: int,
    modes: str,
    rounds: int,
    engine_dir: Path | None,
    baseline: str | None,
    output: str,
) -> None:
    sizes, devices = [int(b) for b in batches.split(",")], [float(d) for d in device_ms.split(",")]
    order = [m.strip() for m in modes.split(",")]
    if not order or any(m not in MODES for m in order):
        raise click.BadParameter(f"{modes!r}: a comma-separated list of {', '.join(MODES)}", param_hint="--modes")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = engine_dir or engine_with_batch(max(sizes), Path(tmp))
        from benchmarks.host_step_ab import export_commit  # (here: a baseline's worker imports its own benchmarks)

        trees = {"baseline": export_commit(baseline, Path(tmp) / "baseline"), "current": HERE} if baseline else {}
        runs = [(code, mode) for mode in order for code in trees] or [(None, mode) for mode in order]
        for batch in sizes:
            for device in devices:
                for round_ in range(rounds):
                    for code, mode in runs if round_ % 2 == 0 else runs[::-1]:
                        if code is None:
                            row = measure(engine_dir, batch, device, steps, MODES[mode])
                        else:
                            row = {**_measure_in(trees[code], engine_dir, batch, device, steps, mode), "code": code}
                        rows.append({**row, "round": round_ + 1})
                        r = rows[-1]
                        click.echo(
                            f"batch {batch:4d}, device {device} ms, core in a {mode}{f' ({code})' if code else ''}: "
                            f"{r['step_ms']} ms a step, "
                            f"device busy {r['device_busy']:.0%}; host µs a step: core {r['engine_core_us']}, text "
                            f"{r['output_thread_us']}, event loop {r['event_loop_us']}; CPU µs a step by thread "
                            f"{r['cpu_us']}"
                        )
    command = (
        f"python -m benchmarks.served_path --batches {batches} --device-ms {device_ms} --steps {steps} "
        f"--modes {modes} --rounds {rounds}" + (f" --baseline {baseline}" if baseline else "")
    )
    write_report(output, {"command": command, "engine": str(engine_dir), "rows": rows}, render)


def _measure_in(tree: Path, engine_dir: Path, batch: int, device_ms: float, steps: int, mode: str) -> dict:
    """`measure` in a process of its own, over the code of `tree` (this file's harness, `tree`'s packages)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    worker = [sys.executable, "-P", __file__, "worker", str(engine_dir.resolve()), str(batch), str(device_ms)]
    out = subprocess.run([*worker, str(steps), mode], cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
        "that takes D ms a step. The engine core runs in a thread of the serving process, or in a process of "
        "its own (EngineArgs.engine_process; the device is simulated there). Host µs per step by part (the "
        "engine thread's wait for the device apart), the device's busy share, and the interval between steps. "
        "Wall-time parts include each thread's waits for the GIL; the CPU columns (each thread's CPU clock) do "
        "not: they are the work itself.",
        "",
        "| batch | device ms | core in | round | ms / step | device busy | core µs | backend µs | output thread µs | "
        "event loop µs | device wait µs | step p50 ms | step p99 ms | CPU µs: engine / outputs / event loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['device_ms']} | {_mode(r)} | {r.get('round', 1)} | {r['step_ms']} | "
        f"{r['device_busy']:.0%} | {r['engine_core_us']} | "
        f"{r['backend_us']} | {r['output_thread_us']} | {r['event_loop_us']} | {r['device_wait_us']} | "
        f"{r['step_interval_p50_ms']} | {r['step_interval_p99_ms']} | {_cpu(r)} |"
        for r in payload["rows"]
    ]
    return "\n".join(lines) + "\n"


def _mode(row: dict) -> str:
    mode = "process" if row.get("engine_process") else "thread"  # (reports before the column: a thread)
    return f"{mode}, {row['code']}" if "code" in row else mode


def _cpu(row: dict) -> str:
    cpu = row.get("cpu_us")  # (reports before the column have none)
    return "" if cpu is None else f"{cpu['engine']} / {cpu['outputs']} / {cpu['event_loop']}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:  # _measure_in's: engine_dir batch device_ms steps mode
        engine, size, device, count, mode = sys.argv[2:]
        print(json.dumps(measure(Path(engine), int(size), float(device), int(count), MODES[mode])))
    else:
        main()

"""`python -m benchmarks.overlap`: does the engine's host work per step hide behind the device's?

A GPU step of a small model takes 1.5-5 ms of device time (benchmarks/results/gpu-h100-2026-11-26); the
engine's host work per step (schedule, pack, update) either runs while the device computes (overlapped
scheduling: the step is launched, the previous one's tokens are read) or adds to it. Without a GPU this
runs the engine over a backend that computes nothing but keeps a simulated device timeline, as one CUDA
stream does: a launched step occupies the device for `--device-ms` after the step before it finished,
and its tokens can be read once it has (a spin-wait, as a CUDA event's synchronize). The steady decode
steps' cadence (wall time per step) is then compared with the device time: the busy share is
device / cadence, 1.0 when the host hides completely. With `overlap_scheduling` off, every step waits
for its own tokens, so the host's time adds to the device's: the same run is the baseline.

What it does not include: the GPU backend's own host work (packing, the graph replay's launch; measured
apart, without a device, by `python -m benchmarks.host_overhead --backend torch`) and the text made on
the output thread.

    python -m benchmarks.overlap [--batches 1,64,256] [--device-ms 1.5,3] [--steps 64] [--repetitions 3]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import click
import numpy as np

from benchmarks.host_overhead import NullBackend, engine_for, engine_with_batch, prefill_all
from benchmarks.report import write_report
from engine_format import EngineConfig
from executors.base import SequenceChunk
from executors.sampling.state import DeviceSample, SamplingState


def _wait_until(deadline: float) -> None:
    """Wait as a CUDA event's synchronize does, without the GIL (the served engine's other threads run meanwhile):
    sleeps, then yields (sleep(0)) through the last 0.2 ms, which a sleep's wake-up would overshoot."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left - 2e-4 if left > 2e-4 else 0)


class _Pending:
    def __init__(self, sample: DeviceSample, done_at: float) -> None:
        self.sample, self.done_at = sample, done_at

    def result(self) -> DeviceSample:
        _wait_until(self.done_at)
        return self.sample


class SimulatedDevice(NullBackend):
    """NullBackend (DeviceSampling and OverlappedSampling) with one stream's timeline: each step runs
    `device_s` on the device, starting when it is launched or when the step before it ends, if later."""

    def __init__(self, config: EngineConfig, num_blocks: int, device_s: float) -> None:
        super().__init__(config, num_blocks)
        self.device_s, self.free_at, self.device_busy_s = device_s, 0.0, 0.0
        self.launches = 0  # steps queued by `launch` (overlapped), not `step_sample`

    def _queue(self) -> float:
        self.free_at = max(time.perf_counter(), self.free_at) + self.device_s
        self.device_busy_s += self.device_s
        return self.free_at

    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None]) -> DeviceSample:
        sample = super().step_sample(chunks, rows)
        _wait_until(self._queue())
        return sample

    def launch(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None], sources: np.ndarray,
               previous: _Pending | None) -> _Pending:  # fmt: skip
        self.launches += 1
        return _Pending(super().step_sample(chunks, rows), self._queue())


def cadence(batch: int, device_s: float, steps: int, engine_dir: Path, overlap: bool) -> dict:
    """Median wall seconds per steady decode step (`step_tokens`, as the served loop), and the device's busy
    share over those steps."""
    device: list[SimulatedDevice] = []

    def make(config: EngineConfig, blocks: int) -> SimulatedDevice:
        device.append(SimulatedDevice(config, blocks, device_s))
        return device[0]

    engine = engine_for(batch, engine_dir, make_backend=make, overlap_scheduling=overlap)
    prefill_all(engine, batch, steps + 8)
    for _ in range(4):  # the launches settle into their steady rhythm
        engine.step_tokens()
    sim = device[0]
    start = time.perf_counter()
    queued, carried_in = sim.device_busy_s, max(0.0, sim.free_at - start)
    walls = []
    for _ in range(steps):
        begin = time.perf_counter()
        engine.step_tokens()
        walls.append(time.perf_counter() - begin)
    end = time.perf_counter()
    # Device time inside [start, end]: queued meanwhile, plus what ran over into it, less what runs past it.
    busy = sim.device_busy_s - queued + carried_in - max(0.0, sim.free_at - end)
    # A device never idle sums to the window within clock rounding (1 + 7e-9 was seen): a share is at most 1.
    return {"step_s": statistics.median(walls), "busy": min(1.0, busy / (end - start)), "launches": sim.launches}


@click.command()
@click.option("--batches", default="1,64,256", show_default=True)
@click.option("--device-ms", default="1.5,3", show_default=True, help="Simulated device time per step, ms.")
@click.option("--steps", default=64, show_default=True, type=click.IntRange(8))
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--output", default="overlap", show_default=True, help="Report name under benchmarks/results/.")
def main(batches: str, device_ms: str, steps: int, repetitions: int, output: str) -> None:
    sizes, devices = [int(b) for b in batches.split(",")], [float(d) for d in device_ms.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = engine_with_batch(max(sizes), Path(tmp))
        for batch in sizes:
            for device in devices:
                row: dict = {"batch": batch, "device_ms": device}
                for mode, overlap in (("overlapped", True), ("serial", False)):
                    runs = [cadence(batch, device / 1e3, steps, engine_dir, overlap) for _ in range(repetitions)]
                    row[f"{mode}_step_ms"] = round(statistics.median(r["step_s"] for r in runs) * 1e3, 3)
                    row[f"{mode}_busy"] = round(statistics.median(r["busy"] for r in runs), 3)
                rows.append(row)
                click.echo(f"batch {batch:4d}, device {device} ms: overlapped {row['overlapped_step_ms']} ms a step "
                           f"(busy {row['overlapped_busy']:.0%}), serial {row['serial_step_ms']} ms")  # fmt: skip
    command = (f"python -m benchmarks.overlap --batches {batches} --device-ms {device_ms} --steps {steps} "
               f"--repetitions {repetitions}")  # fmt: skip
    write_report(output, {"command": command, "rows": rows}, render)


def render(payload: dict) -> str:
    m = payload.get("machine", {})
    machine = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores ({m.get('platform', '?')})"
    lines = ["# Overlapped scheduling over a simulated device (no GPU)", "",
             f"Machine: {machine}; {payload.get('date_utc', '')}",
             "", f"Command: `{payload['command']}`", "",
             "The engine over a no-work backend whose steps each occupy a simulated device (one stream) for the "
             "given time; wall time per steady decode step (median of repetitions) and the device's busy share.",
             "", "| batch | device ms / step | overlapped: ms / step | busy | serial: ms / step | busy |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['batch']} | {r['device_ms']} | {r['overlapped_step_ms']} | {r['overlapped_busy']:.0%} | "
              f"{r['serial_step_ms']} | {r['serial_busy']:.0%} |" for r in payload["rows"]]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""`python -m benchmarks.backend_steps`: one engine step's wall time on each CPU backend, by step shape.

In process, no scheduler: the backend's own `step()` on representative shapes (decodes of 1, 8 and 32
sequences at a given context, prefill chunks with and without context), each after one untimed run of
the same shape. Every backend runs in a fresh process: OpenMP reads its settings once per process, and
each CPU backend sets its own (`cpu`: passive workers beside ONNX Runtime; `cpu-bf16`: ~1 ms of spinning
between torch's ops), so a shared process would time the second backend under the first one's policy.
Writes results/<name>.{json,md}: median (min-max) ms per shape and backend, and each shape's speedup
over the first backend.

    python -m benchmarks.backend_steps --engine /work/engines/v3/smollm2-135m-b32 --backends cpu,cpu-bf16
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

from benchmarks.cpu import wait_quiet
from benchmarks.report import write_report

# (label, sequences, context tokens already in the pool, new tokens per sequence, logits per sequence).
# "verify": a decode with 3 speculative drafts per sequence, logits for all 4 tokens.
SHAPES = [
    ("decode, 1 sequence, 470 context", 1, 470, 1, 1),
    ("decode, 8 sequences, 470 context", 8, 470, 1, 1),
    ("decode, 32 sequences, 470 context", 32, 470, 1, 1),
    ("verify, 32 sequences x 4 tokens, 470 context", 32, 470, 4, 4),
    ("prefill chunk of 64 tokens after 100", 1, 100, 64, 1),
    ("prefill, 8 x 64 tokens", 8, 0, 64, 1),
    ("prefill, 512 tokens", 1, 0, 512, 1),
]


def time_backend(engine: Path, kind: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of each shape (this process: one backend)."""
    import numpy as np

    from engine_format import EngineConfig, ceil_div
    from executors import create_backend
    from executors.base import SequenceChunk

    config = EngineConfig.load(engine)
    per_seq = ceil_div(max(ctx + new for _, _, ctx, new, _ in SHAPES), config.block_size)
    backend = create_backend(config, max(n for _, n, *_ in SHAPES) * per_seq, kind=kind)
    rng = np.random.default_rng(0)
    out = {}
    for label, seqs, ctx, new, logits in SHAPES:
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(seqs)]
        for table in tables if ctx else []:  # the context, written by a prefill of its own
            backend.step([SequenceChunk(rng.integers(3, 1000, ctx).tolist(), 0, table)])
        step = [SequenceChunk(rng.integers(3, 1000, new).tolist(), ctx, table, logits) for table in tables]
        backend.step(step)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.step(step)
            times.append(time.perf_counter() - start)
        out[label] = times
    return out


def render(p: dict) -> str:
    backends = p["backends"]
    lines = [
        "# One engine step per CPU backend",
        "",
        f"Machine: {p['machine']['cpu']}, {p['machine']['cores']} cores; run {p['date_utc']}. "
        f"Command: `{p['command']}`",
        "",
        f"Engine {p['engine']}; `step()` alone (no scheduler), each backend in its own process, median (min–max) "
        f"of {p['repeats']} timed steps after one untimed; random token ids.",
        "",
        "| step | " + " | ".join([f"{b} ms" for b in backends] + [f"{b} speedup" for b in backends[1:]]) + " |",
        "|---" * (2 * len(backends)) + "|",
    ]
    for label, *_ in SHAPES:
        cells, medians = [], []
        for b in backends:
            ms = [1000 * t for t in p["times"][b][label]]
            medians.append(statistics.median(ms))
            cells.append(f"{medians[-1]:.1f} ({min(ms):.1f}–{max(ms):.1f})")
        speedups = [f"{medians[0] / m:.2f}x" for m in medians[1:]]
        lines.append(f"| {label} | " + " | ".join(cells + speedups) + " |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--backends", default="cpu,cpu-bf16", show_default=True, help="Comma-separated; the first is the base.")
@click.option("--repeats", default=7, show_default=True, type=click.IntRange(1))
@click.option("--name", default="backend_steps", show_default=True)
@click.option("--worker", hidden=True, default=None, help="Time this one backend and print JSON (internal).")
def main(engine: Path, backends: str, repeats: int, name: str, worker: str | None) -> None:
    if worker:
        click.echo(json.dumps(time_backend(engine, worker, repeats)))
        return
    kinds = [b for b in backends.split(",") if b]
    times = {}
    for kind in kinds:
        wait_quiet(lambda s: click.echo(s, err=True))
        command = [sys.executable, "-m", "benchmarks.backend_steps", "--engine", str(engine), "--repeats",
                   str(repeats), "--worker", kind]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, check=True)
        times[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    payload = {"command": "python -m benchmarks.backend_steps " + shlex.join(sys.argv[1:]), "engine": str(engine),
               "backends": kinds, "repeats": repeats, "times": times}  # fmt: skip
    md, _ = write_report(name, payload, render)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

"""`python -m benchmarks.decode_profile`: where a CPU decode step's time goes, by part, per backend.

In process, no server: one backend's own `step()` on decodes of 1/4/16/32 sequences at a short and a long
context (after a prefill that writes the context), each part timed by wrapping the backend module's own
functions (nothing re-implemented): the dense layers (ONNX Runtime segment runs for `cpu`; the int8
quantize/matmul/RMSNorm/RoPE calls for `cpu-int8`), the attention kernel, the KV writes, packing the flat
step, and the rest (Python glue). Every backend runs in a fresh process (OpenMP reads its policy once per
process). Beside each step: the floor of this machine, the bytes a decode step must read (every weight once,
in the backend's format, plus each sequence's K/V) over the streaming bandwidth measured here.

Then the sampler: one step of B rows of SmolLM2 logits (a real prompt's), temperature 0.7 with and without
top-p 0.9, per sampled row: today's sampler against the full sort every row took before (its copy below,
kept for this comparison). Writes results/<name>.{json,md} and a stacked-bar PNG.

    python -m benchmarks.decode_profile --engine engines/smollm2-135m          # ~4 min on 2 cores
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import numpy as np

from benchmarks.cpu import wait_quiet
from benchmarks.report import RESULTS_DIR, write_report

BATCHES = (1, 4, 16, 32)
CONTEXTS = (100, 1000)
PARTS = ("dense", "attention", "kv_write", "pack", "other")
DENSE = {  # the functions each backend's module calls for its dense layers
    "cpu-int8": ("linear", "quantize_rows", "rms_norm_quantize", "silu_mul_quantize", "rope_split"),
    "cpu-bf16": ("_linear", "rms_norm", "rope_split"),
}


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def instrumented(backend, kind: str, timers: Timers) -> Iterator[None]:
    """Wrap the backend's own calls: the dense layers, the attention kernel, KV writes and packing."""
    import importlib

    import executors.flat_step

    module = importlib.import_module(type(backend).__module__)
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, part: str) -> None:
        # a class keeps its own attribute (a classmethod) to put back; instances may be frozen dataclasses
        saved.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        _set(owner, name, timers.wrap(part, getattr(owner, name)))

    if kind == "cpu":  # ONNX Runtime segments carry the dense layers; the whole graph serves small steps
        for session in backend.segments:
            patch(session, "run", "dense")
        if backend.small_steps is not None:
            patch(backend.small_steps, "step", "dense")
    for name in DENSE.get(kind, ()):
        patch(module, name, "dense")
    patch(module, "paged_attention", "attention")
    patch(backend.kv, "write", "kv_write")
    patch(executors.flat_step.FlatStep, "pack", "pack")
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            _set(owner, name, original)


def _set(owner: object, name: str, value: object) -> None:
    if isinstance(owner, type):
        setattr(owner, name, value)
    else:
        object.__setattr__(owner, name, value)


def profile_backend(engine: Path, kind: str, repeats: int) -> dict:
    """Per (batch, context): median step ms and the parts of that median step (this process: one backend)."""
    from engine_format import EngineConfig, ceil_div
    from executors import create_backend
    from executors.base import SequenceChunk

    config = EngineConfig.load(engine)
    per_seq = ceil_div(max(CONTEXTS) + 1, config.block_size)
    backend = create_backend(config, max(BATCHES) * per_seq, kind=kind)
    rng = np.random.default_rng(0)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(max(BATCHES))]
    out: dict[str, dict] = {}
    for context in CONTEXTS:
        for table in tables:  # each sequence's context, written by a prefill of its own
            backend.step([SequenceChunk(rng.integers(3, 1000, context).tolist(), 0, table)])
        for batch in BATCHES:
            step = [SequenceChunk([int(rng.integers(3, 1000))], context, table) for table in tables[:batch]]
            backend.step(step)
            runs = []
            for _ in range(repeats):
                timers = Timers()
                with instrumented(backend, kind, timers):
                    start = time.perf_counter()
                    backend.step(step)
                    total = time.perf_counter() - start
                parts = {p: 1000 * timers.seconds.get(p, 0.0) for p in PARTS[:-1]}
                parts["other"] = 1000 * total - sum(parts.values())
                runs.append({"step_ms": 1000 * total, **parts})
            median = sorted(runs, key=lambda r: r["step_ms"])[len(runs) // 2]
            out[f"{batch}x{context}"] = {**median, "min_ms": min(r["step_ms"] for r in runs),
                                         "max_ms": max(r["step_ms"] for r in runs)}  # fmt: skip
    return out


def weight_bytes(engine: Path, kind: str) -> int:
    """Bytes of weights a decode step reads once: every matmul weight and the LM head, in the backend's format."""
    from engine_format import EngineConfig

    spec = EngineConfig.load(engine).model
    width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_layer = spec.hidden_size * (width + spec.hidden_size + 3 * spec.intermediate_size)
    params = spec.num_layers * per_layer + spec.vocab_size * spec.hidden_size
    return params * {"cpu-int8": 1, "cpu-bf16": 2}.get(kind, 4)


def kv_bytes(engine: Path, batch: int, context: int) -> int:
    from engine_format import EngineConfig
    from engine_format.kv_cache import bytes_per_token

    config = EngineConfig.load(engine)
    return batch * context * bytes_per_token(config.model, config.dtype, config.kv_cache_dtype)


def streaming_gb_s() -> float:
    """GB/s of a streaming read over 400 MB on every usable core: a numpy sum per core over its share (numpy
    releases the GIL in the loop), best of 5."""
    from concurrent.futures import ThreadPoolExecutor

    from executors.cpus import usable_cpus

    threads = usable_cpus()
    data = np.ones(100_000_000, np.float32)
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - start)
    return data.nbytes / min(times) / 1e9


# ---- the sampler: today's against the full sort every sampled row paid before ----


def full_sort_draw(x: np.ndarray, temperature: float, top_p: float, u: np.ndarray) -> np.ndarray:
    """The sampler's draw as it was before this wave (a copy for the comparison): argsort each row whole,
    cumulative sums in float64 over it, top-p and the inverse CDF in sorted order."""
    scaled = (x - x.max(axis=1, keepdims=True)) / np.float32(temperature)
    order = np.argsort(-scaled, axis=1)
    p = np.exp(np.take_along_axis(scaled, order, axis=1))
    cdf = np.cumsum(p.astype(np.float64), axis=1)
    n_keep = np.where(top_p >= 1.0, x.shape[1], 1 + np.count_nonzero(cdf[:, :-1] < top_p * cdf[:, -1:], axis=1))
    target = u * cdf[np.arange(len(u)), n_keep - 1]
    pos = np.minimum(np.count_nonzero(cdf <= target[:, None], axis=1), n_keep - 1)
    return np.take_along_axis(order, pos[:, None], axis=1)[:, 0]


def sampling_costs(engine: Path, batches: tuple[int, ...], repeats: int) -> list[dict]:
    """ms per sampled row per step, today's sampler vs the full sort, on real logits of the engine."""
    from engine_format import EngineConfig, ceil_div
    from executors import create_backend
    from executors.base import SequenceChunk
    from executors.sampling import Sampler, SamplingParams, SamplingState
    from runtime.engine.tokenizer import load_tokenizer

    config = EngineConfig.load(engine)
    tokenizer = load_tokenizer(engine)
    text = ("Once upon a time, in a small village by the sea, there lived an old fisherman who told stories "
            "about the stars to the children every night.") * 2  # fmt: skip
    ids = tokenizer.encode(text)
    backend = create_backend(config, ceil_div(len(ids), config.block_size), kind="cpu")
    logits = backend.prompt_logits(SequenceChunk(ids, 0, list(range(ceil_div(len(ids), config.block_size)))))
    rows = []
    for batch in batches:
        x = np.ascontiguousarray(np.resize(logits[-32:], (batch, logits.shape[1])), np.float32)
        for top_p in (1.0, 0.9):
            params = SamplingParams(temperature=0.7, top_p=top_p, seed=0)
            states = [SamplingState(params, [], x.shape[1]) for _ in range(batch)]
            sampler, u = Sampler(), np.random.default_rng(0).random(batch)
            now = _median_ms(functools.partial(sampler.sample, x, states), repeats)
            before = _median_ms(functools.partial(full_sort_draw, x, 0.7, top_p, u), repeats)
            rows.append(
                {"batch": batch, "top_p": top_p, "ms_per_row": now / batch, "full_sort_ms_per_row": before / batch}
            )
    return rows


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


# ---- report ----


def render(p: dict) -> str:
    kinds = p["backends"]
    lines = [
        "# Where a CPU decode step's time goes",
        "",
        f"Machine: {p['machine']['cpu']}, {p['machine']['cores']} cores; run {p['date_utc']}. "
        f"Command: `{p['command']}`",
        "",
        f"Engine {p['engine']}; `step()` alone (no scheduler), each backend in its own process; median of "
        f"{p['repeats']} steps (its parts are that step's), min–max of the step. Decode of B sequences, each over "
        f"C tokens of context. Floor: the weights in the backend's format plus the K/V read, at {p['gb_s']:.1f} GB/s "
        "(a streaming read on every core).",
        "",
        "| B x C | backend | step ms (min–max) | dense | attention | KV write | pack | other | floor ms | x floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in p["profiles"][kinds[0]]:
        batch, context = (int(v) for v in shape.split("x"))
        for kind in kinds:
            r = p["profiles"][kind][shape]
            floor = 1000 * (p["weight_bytes"][kind] + p["kv_bytes"][shape]) / (p["gb_s"] * 1e9)
            lines.append(
                f"| {batch} x {context} | {kind} | {r['step_ms']:.1f} ({r['min_ms']:.1f}–{r['max_ms']:.1f}) | "
                + " | ".join(f"{r[part]:.1f}" for part in PARTS)
                + f" | {floor:.1f} | {r['step_ms'] / floor:.1f}x |"
            )
    lines += ["", "## Sampling, per sampled row per step", "",
              "Temperature 0.7; SmolLM2 logits of a real prompt. Before: every row sorted whole (the sampler as it "
              "was).",
              "", "| rows | top-p | now ms/row | before ms/row | speedup |", "|---|---|---|---|---|"]  # fmt: skip
    for r in p["sampling"]:
        lines.append(f"| {r['batch']} | {r['top_p']} | {r['ms_per_row']:.3f} | {r['full_sort_ms_per_row']:.2f} | "
                     f"{r['full_sort_ms_per_row'] / r['ms_per_row']:.0f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def write_plot(p: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = p["backends"]
    shapes = list(p["profiles"][kinds[0]])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(kinds)
    colors = {"dense": "#4c72b0", "attention": "#dd8452", "kv_write": "#55a868", "pack": "#c44e52", "other": "#8c8c8c"}
    for k, kind in enumerate(kinds):
        bottom = np.zeros(len(shapes))
        xs = np.arange(len(shapes)) + k * width
        for part in PARTS:
            values = np.array([max(p["profiles"][kind][s][part], 0.0) for s in shapes])
            ax.bar(xs, values, width, bottom=bottom, color=colors[part], label=part if k == 0 else None,
                   edgecolor="black", linewidth=0.3)  # fmt: skip
            bottom += values
        for x, top in zip(xs, bottom, strict=True):
            ax.text(x, top, kind, rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(shapes)) + width * (len(kinds) - 1) / 2, [s.replace("x", " x ") for s in shapes])
    ax.set_xlabel("decode: sequences x context tokens")
    ax.set_ylabel("ms per step")
    ax.set_title("Decode step by part (SmolLM2-135M)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"{name}.png", dpi=120)


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--backends", default="cpu,cpu-int8", show_default=True, help="Comma-separated executors.BACKENDS.")
@click.option("--repeats", default=7, show_default=True, type=click.IntRange(1))
@click.option("--name", default="decode_profile", show_default=True)
@click.option("--worker", hidden=True, default=None, help="Profile this one backend and print JSON (internal).")
def main(engine: Path, backends: str, repeats: int, name: str, worker: str | None) -> None:
    if worker:
        click.echo(json.dumps(profile_backend(engine, worker, repeats)))
        return
    kinds = [b for b in backends.split(",") if b]
    profiles = {}
    for kind in kinds:
        wait_quiet(lambda s: click.echo(s, err=True))
        command = [sys.executable, "-m", "benchmarks.decode_profile", "--engine", str(engine), "--repeats",
                   str(repeats), "--worker", kind]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, check=True)
        profiles[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    shapes = [f"{b}x{c}" for c in CONTEXTS for b in BATCHES]
    payload = {
        "command": "python -m benchmarks.decode_profile " + shlex.join(sys.argv[1:]),
        "engine": str(engine), "backends": kinds, "repeats": repeats, "profiles": profiles,
        "gb_s": streaming_gb_s(), "weight_bytes": {k: weight_bytes(engine, k) for k in kinds},
        "kv_bytes": {s: kv_bytes(engine, *(int(v) for v in s.split("x"))) for s in shapes},
        "sampling": sampling_costs(engine, (1, 16, 32), repeats),
    }  # fmt: skip
    md, full = write_report(name, payload, render)
    write_plot(full, name)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

"""`python -m benchmarks.host_overhead`: the engine loop's own cost, over a backend that does no work.

A GPU step of a small model takes a few milliseconds of device time; whatever the host does per step in
series with it (scheduling, packing, the state update) is time the GPU waits. This measures that host path
alone: the engine core's step (`LLMEngine.step_tokens`) over NullBackend, which samples on its "device"
instantly (as the torch backend returns token ids) and never touches a tensor. Turning tokens into text
(the output processor) runs apart from the step in the served engine (AsyncLLM's output thread); its cost
is reported beside, per token. An engine without `step_tokens` (before the split) is timed by `step()`,
which did both. B requests decode together (prompt 16 tokens, EOS ignored); the steady decode steps are
timed, reported as µs per step and µs per request-step, median and spread over repetitions.

`--backend torch`: the same over the torch backend on the CPU with its kernels removed (Decoder.forward
returns one zero logit a row at once, so the sampler's ops run on tiny tensors; the graph buckets run that
stand-in eagerly): the engine core plus the torch
backend's own host work per step (checking and packing the chunks, the step buffer, the bucket's copies,
the sampler's set-up), with that backend share reported apart. On a GPU this host work runs while the
device waits unless it is overlapped.

    python -m benchmarks.host_overhead [--batches 1,16,64,256,1024] [--steps 64] [--repetitions 5]
                                       [--backend null|torch]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import click
import numpy as np

from benchmarks.report import write_report
from engine_format import EngineConfig
from executors.base import SequenceChunk
from executors.sampling.state import DeviceSample, SamplingState

PROMPT_TOKENS = 16
TOKEN = 7  # every sampled token (not an EOS of the tiny tokenizer)


class NullBackend:
    """An EngineBackend and DeviceSampling that computes nothing: each sampled row gets TOKEN at once."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config, self.num_blocks = config, num_blocks

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        rows = sum(c.num_logits for c in chunks)
        return np.zeros((rows, self.config.model.vocab_size), np.float32)

    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None]) -> DeviceSample:
        tokens = np.full(len(chunks), TOKEN, np.int64)
        tokens[[i for i, row in enumerate(rows) if row is None]] = -1
        return DeviceSample(tokens, [None] * len(chunks))


def torch_without_kernels(config: EngineConfig, num_blocks: int, batch: int):
    """The torch backend on the CPU, its decoder replaced by zero logits: only its host work is left."""
    import torch

    from executors.torch import TorchBackend

    backend = TorchBackend(config, num_blocks, device="cpu", cuda_graphs=True, graph_buckets=(batch,))

    def forward(step, lora=None) -> torch.Tensor:  # one logit a row: the sampler's argmax costs nothing here
        return torch.zeros(step.logit_rows.shape[0], 1)

    backend.decoder.forward = forward  # type: ignore[method-assign]
    if backend.graphs is not None:
        backend.graphs.forward = forward
    return backend


class BackendClock:
    """Wraps a backend's step entry points on the instance, adding up the seconds spent inside them."""

    def __init__(self, backend) -> None:
        self.seconds = 0.0
        for name in ("step", "step_sample", "launch"):
            if hasattr(backend, name):
                setattr(backend, name, self._timed(getattr(backend, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def engine_for(batch: int, engine_dir: Path, backend_kind: str = "null", make_backend=None, **args):
    """An engine for `batch` requests over the null backend, the torch one without kernels, or
    `make_backend(config, num_blocks)`; `args`: more EngineArgs."""
    from runtime.engine.engine_args import EngineArgs
    from runtime.engine.llm_engine import LLMEngine

    config = EngineConfig.load(engine_dir)
    blocks = batch * (PROMPT_TOKENS + 1024) // config.block_size + batch
    engine_args = EngineArgs(max_num_seqs=batch, max_num_batched_tokens=max(batch * PROMPT_TOKENS, 512),
                             num_kv_blocks=blocks, itl_target_ms=None, max_waiting=batch, **args)  # fmt: skip
    if make_backend is not None:
        backend = make_backend(config, blocks)
    elif backend_kind == "null":
        backend = NullBackend(config, blocks)
    else:
        backend = torch_without_kernels(config, blocks, batch)
    return LLMEngine(engine_dir, engine_args, backend=backend)


def prefill_all(engine, batch: int, max_tokens: int) -> None:
    """`batch` greedy requests of PROMPT_TOKENS, EOS ignored, stepped until every prompt is computed."""
    from executors.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request([1 + (i + j) % 50 for j in range(PROMPT_TOKENS)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


def time_steps(batch: int, steps: int, engine_dir: Path,
               backend_kind: str = "null") -> tuple[list[float], list[float], list[float]]:  # fmt: skip
    """Seconds of each steady decode step of `batch` requests (after every prompt has been prefilled), of
    turning each step's tokens into text (empty before the split: `step()` timed both), and of the
    backend's calls within each step."""
    engine = engine_for(batch, engine_dir, backend_kind)
    clock = BackendClock(engine.backend)
    prefill_all(engine, batch, steps + 2)
    seconds, text, in_backend = [], [], []
    split = hasattr(engine, "step_tokens")
    for _ in range(steps):
        clock.seconds = 0.0
        start = time.perf_counter()
        outputs = engine.step_tokens() if split else engine.step()
        seconds.append(time.perf_counter() - start)
        in_backend.append(clock.seconds)
        if split:
            start = time.perf_counter()
            engine.outputs.process(outputs)
            text.append(time.perf_counter() - start)
    return seconds, text, in_backend


def gc_pauses(batch: int, steps: int, engine_dir: Path) -> list[dict]:
    """Step-time spread of `steps` steady decode steps of `batch` requests with the heap as start-up left it, then
    the next `steps` after freeze_startup_heap (what the served process does): Python's full collections walk
    every object start-up made (torch, transformers, the engine), which a median hides and the GPU waits on."""
    import gc

    import torch  # noqa: F401  (a serving process holds these: their objects are in the heap the collector walks)
    import transformers  # noqa: F401

    from runtime.engine.heap import freeze_startup_heap

    engine = engine_for(batch, engine_dir)
    prefill_all(engine, batch, 2 * steps + 2)
    rows = []
    try:
        for frozen in (False, True):
            if frozen:
                freeze_startup_heap("host_overhead")
            collections = gc.get_stats()[2]["collections"]
            seconds = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step_tokens()
                seconds.append(time.perf_counter() - start)
            us = sorted(s * 1e6 for s in seconds)
            rows.append({"heap": "frozen after start" if frozen else "as start left it", "batch": batch,
                         "steps": steps, "median_us": round(statistics.median(us), 1),
                         "p99_us": round(us[int(0.99 * (len(us) - 1))], 1), "max_us": round(us[-1], 1),
                         "mean_us": round(statistics.mean(us), 1),
                         "full_collections": gc.get_stats()[2]["collections"] - collections})  # fmt: skip
    finally:
        gc.unfreeze()
    return rows


def engine_with_batch(max_batch: int, workdir: Path) -> Path:
    """The tiny test model built for `max_batch` sequences (the null backend never reads its weights)."""
    from builder.build import BuildOptions, build_engine

    out = workdir / f"tiny-b{max_batch}"
    if not out.exists():
        build_engine(BuildOptions(model="tiny-llama", output=out, max_batch_size=max_batch, max_seq_len=512,
                                  block_size=16))  # fmt: skip
    return out


@click.command()
@click.option("--batches", default="1,16,64,256,1024", show_default=True)
@click.option("--steps", default=64, show_default=True, type=click.IntRange(4))
@click.option("--repetitions", default=5, show_default=True, type=click.IntRange(1))
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="An engine whose max batch size covers the largest batch (default: the tiny model, built).",
)
@click.option(
    "--backend",
    "backend_kind",
    type=click.Choice(["null", "torch"]),
    default="null",
    show_default=True,
    help="null: no work at all; torch: the torch backend's host work, its kernels removed.",
)
@click.option("--gc-steps", default=0, show_default=True, type=click.IntRange(0, 240),
              help="Also time this many steps at batch 256 before and after freezing the start-up heap (0: skip; "
                   "twice this many tokens fit the tiny engine's 512 context).")  # fmt: skip
@click.option("--output", default=None, help="Report name under benchmarks/results/ (default host_overhead[-torch]).")
def main(batches: str, steps: int, repetitions: int, engine_dir: Path | None, backend_kind: str, gc_steps: int,
         output: str | None) -> None:  # fmt: skip
    sizes = [int(b) for b in batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = engine_dir or engine_with_batch(max(sizes), Path(tmp))
        rows = []
        for batch in sizes:
            runs = [time_steps(batch, steps, engine_dir, backend_kind) for _ in range(repetitions)]
            per_rep = [statistics.median(step_s) for step_s, _, _ in runs]
            text_s = [statistics.median(t) for _, t, _ in runs if t]
            backend_us = statistics.median(statistics.median(b) for _, _, b in runs) * 1e6
            median = statistics.median(per_rep)
            text_us = round(statistics.median(text_s) * 1e6 / batch, 2) if text_s else None
            rows.append({"batch": batch, "us_per_step": round(median * 1e6, 1),
                         "us_per_step_min": round(min(per_rep) * 1e6, 1),
                         "us_per_step_max": round(max(per_rep) * 1e6, 1),
                         "us_per_request_step": round(median * 1e6 / batch, 2),
                         "text_us_per_token": text_us, "backend_us_per_step": round(backend_us, 1)})  # fmt: skip
            click.echo(f"batch {batch:5d}: {rows[-1]['us_per_step']:9.1f} us/step "
                       f"({rows[-1]['us_per_request_step']:.2f} us per request-step)")  # fmt: skip
        gc_rows = gc_pauses(256, gc_steps, engine_dir) if gc_steps else []
    payload = {"command": f"python -m benchmarks.host_overhead --batches {batches} --steps {steps} "
                          f"--repetitions {repetitions} --backend {backend_kind} --gc-steps {gc_steps}",
               "backend": backend_kind, "rows": rows, "gc_rows": gc_rows}  # fmt: skip
    write_report(output or ("host_overhead" if backend_kind == "null" else f"host_overhead-{backend_kind}"), payload,
                 render)  # fmt: skip


def render(payload: dict) -> str:
    backend = payload.get("backend", "null")
    title = "null backend" if backend == "null" else "torch backend, kernels removed"
    lines = [f"# Engine host overhead ({title})", "", f"Machine: {payload.get('machine', '?')}", "",
             f"Command: `{payload['command']}`", "",
             "| batch | µs/step (median) | min | max | µs per request-step | of which in the backend, µs/step | "
             "text, µs per token (output processor) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['batch']} | {r['us_per_step']} | {r['us_per_step_min']} | {r['us_per_step_max']} | "
              f"{r['us_per_request_step']} | {r.get('backend_us_per_step', '-')} | "
              f"{r.get('text_us_per_token') or '- (in the step)'} |" for r in payload["rows"]]  # fmt: skip
    if payload.get("gc_rows"):
        lines += ["", "Step times in one process, the null backend, the heap as start-up left it and then frozen "
                  "(runtime/engine/heap.py):", "",
                  "| heap | batch | steps | median µs | p99 µs | max µs | mean µs | full collections |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['heap']} | {r['batch']} | {r['steps']} | {r['median_us']} | {r['p99_us']} | {r['max_us']} | "
                  f"{r['mean_us']} | {r['full_collections']} |" for r in payload["gc_rows"]]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

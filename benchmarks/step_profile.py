"""`python -m benchmarks.step_profile`: where a CPU engine step's wall time goes at saturation (issue 17).

In process (`LLMEngine`, no server): the mixed chat workload (benchmarks.datasets.mixed) kept at
saturation in a closed loop (--outstanding requests in flight, so 32 decode and prompts always wait),
then every step's wall time split into: ONNX Runtime segment runs (the dense layers; the last one
carries the LM head), the paged-attention kernel, KV writes, packing the flat step, scheduling,
sampling, detokenization and the rest of postprocessing, and what is left (Python glue). Then the
dense layers alone: one middle segment timed at several token counts, with 1 and all threads, in
GFLOP/s, which shows what a step of M = 8-32 tokens gets out of the cores. Writes
results/<name>.{json,md}.

    python -m benchmarks.step_profile --engine /work/engines/v3/smollm2-135m-b32

The timers wrap the engine's own objects (the backend's sessions, its kernel entry, the sampler);
nothing is re-implemented, so the profile is of the code that serves.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import click
import numpy as np

import executors.ort_cpu as ort_cpu
import runtime.engine.llm_engine as llm_engine
from benchmarks import datasets
from benchmarks.cpu import wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.report import write_report
from engine_format.files import segment_file
from executors.kv_pool import KVPool
from executors.ort_session import create_session
from runtime import EngineArgs, LLMEngine, SamplingParams
from runtime.engine.detokenizer import DetokenizedStream

PARTS = ("ort_first", "ort_layers", "ort_last_lm_head", "attention_kernel", "kv_write", "pack", "schedule",
         "build_chunks", "sample", "detokenize", "postprocess_other", "python_other")  # fmt: skip


class Timers:
    """Seconds per part, accumulated for the current step; `close_step` files them under the step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        parts, self.current = dict(self.current), defaultdict(float)
        return parts


class TimedSession:
    """An ORT session whose runs are timed under `part`."""

    def __init__(self, session: Any, timers: Timers, part: str) -> None:
        self.run = timers.wrap(part, session.run)


@contextlib.contextmanager
def instrumented(engine: LLMEngine, timers: Timers) -> Iterator[None]:
    """The engine's step parts timed into `timers` while inside (the patched attributes restored after)."""
    backend = engine.backend
    if not isinstance(backend, ort_cpu.OrtCpuBackend):
        raise click.UsageError("the step profile is of the CPU kernel backend (engine built for the cpu target)")
    last = len(backend.segments) - 1
    parts = ["ort_first" if i == 0 else "ort_last_lm_head" if i == last else "ort_layers" for i in range(last + 1)]
    timed = [TimedSession(s, timers, part) for s, part in zip(backend.segments, parts, strict=True)]
    targets = [  # (object, attribute, part)
        (ort_cpu, "paged_attention", "attention_kernel"), (KVPool, "write", "kv_write"),  # KVPool: a frozen dataclass
        (ort_cpu.FlatStep, "pack", "pack"), (engine.scheduler, "schedule", "schedule"),
        (llm_engine, "build_chunks", "build_chunks"), (engine.update.sampler, "sample", "sample"),
        (DetokenizedStream, "add", "detokenize"), (engine.update, "run", "postprocess"),
    ]  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(patch.object(backend, "small_steps", None))  # saturation: every step has many sequences
        stack.enter_context(patch.object(backend, "segments", timed))
        for owner, name, part in targets:
            stack.enter_context(patch.object(owner, name, timers.wrap(part, getattr(owner, name))))
        yield


def saturated_steps(engine: LLMEngine, requests: Iterator[BenchRequest], outstanding: int, warmup: int,
                    steps: int) -> list[dict]:  # fmt: skip
    """Run `requests` closed-loop (`outstanding` in flight, greedy, EOS ignored); one record per measured step."""

    def submit() -> None:
        r = next(requests)
        engine.add_request(list(r.prompt_ids), SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))

    timers = Timers()
    with instrumented(engine, timers):
        return _run_steps(engine, timers, submit, outstanding, warmup, steps)


def _run_steps(engine: LLMEngine, timers: Timers, submit: Callable[[], None], outstanding: int, warmup: int,
               steps: int) -> list[dict]:  # fmt: skip
    for _ in range(outstanding):
        submit()
    records = []
    for index in range(warmup + steps):
        timers.take()
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        parts = timers.take()
        for out in outputs:
            if out.finished:
                submit()
        if index < warmup:
            continue
        step = engine.counters.recent_steps[-1]
        # The step's update (sampling inside it); detokenization runs after it, in the output processor.
        parts["postprocess_other"] = parts.pop("postprocess", 0.0) - parts.get("sample", 0.0)
        parts["python_other"] = wall - sum(parts.values())
        records.append({"wall_s": wall, "decode_seqs": step.decode_seqs, "prefill_tokens": step.prefill_tokens,
                        "parts_s": parts})  # fmt: skip
    return records


def breakdown(records: list[dict]) -> dict:
    """Share of wall time per part, and ms per step, over the given steps."""
    wall = sum(r["wall_s"] for r in records)
    return {
        "steps": len(records),
        "ms_per_step": round(1000 * wall / max(1, len(records)), 1),
        "decode_seqs_mean": round(statistics.fmean(r["decode_seqs"] for r in records), 1) if records else 0,
        "prefill_tokens_mean": round(statistics.fmean(r["prefill_tokens"] for r in records), 1) if records else 0,
        "parts": {
            p: {"ms_per_step": round(1000 * sum(r["parts_s"].get(p, 0.0) for r in records) / max(1, len(records)), 2),
                "share": round(sum(r["parts_s"].get(p, 0.0) for r in records) / wall, 4) if wall else 0.0}
            for p in PARTS
        },
    }  # fmt: skip


def layer_flops_per_token(engine: LLMEngine) -> float:
    """A middle segment's dense FLOPs per token: the previous layer's o_proj + MLP, this layer's QKV."""
    m = engine.config.model
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    intermediate = m.intermediate_size
    return 2.0 * (q * m.hidden_size + 3 * m.hidden_size * intermediate + m.hidden_size * (q + 2 * kv))


def gemm_efficiency(engine: LLMEngine, token_counts: list[int], repeats: int) -> list[dict]:
    """A middle segment alone at each token count, with one thread and with all: ms and GFLOP/s."""
    config, backend = engine.config, engine.backend
    assert isinstance(backend, ort_cpu.OrtCpuBackend)
    path = config.engine_dir / segment_file(config.model.num_layers // 2)
    flops = layer_flops_per_token(engine)
    q_width = config.model.num_heads * config.model.head_dim
    rows = []
    for threads in sorted({1, backend.threads}):
        session = create_session(path, threads, spinning=False)
        for tokens in token_counts:
            rng = np.random.default_rng(0)
            feeds = {
                "hidden": rng.standard_normal((tokens, 1, config.model.hidden_size), np.float32),
                "attn": rng.standard_normal((tokens, 1, q_width), np.float32),
                "positions": np.arange(tokens, dtype=np.int64)[:, None],
            }
            session.run(None, feeds)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            rows.append({"threads": threads, "tokens": tokens, "ms": round(1000 * median, 3),
                         "gflops": round(flops * tokens / median / 1e9, 1)})  # fmt: skip
    return rows


def render(payload: dict) -> str:
    lines = [
        "# Step profile at saturation (issue 17)",
        "",
        f"`{payload['command']}` — {payload['machine']['cpu']}, {payload['machine']['cores']} cores.",
        f"Workload: {payload['workload']}",
        "",
        "| part | " + " | ".join(f"{k} ms/step (share)" for k in payload["breakdown"]) + " |",
        "|---|" + "---|" * len(payload["breakdown"]),
    ]
    groups = payload["breakdown"]
    for part in PARTS:
        cells = [f"{g['parts'][part]['ms_per_step']} ({100 * g['parts'][part]['share']:.1f}%)" for g in groups.values()]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    walls = [f"**{g['ms_per_step']}** ({g['steps']} steps, {g['decode_seqs_mean']} decodes + "
             f"{g['prefill_tokens_mean']} prefill tokens)" for g in groups.values()]  # fmt: skip
    lines.append("| **step wall** | " + " | ".join(walls) + " |")
    lines += ["", "One middle segment alone (o_proj + MLP + QKV/RoPE of a layer), median of runs:", "",
              "| threads | tokens | ms | GFLOP/s |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['threads']} | {r['tokens']} | {r['ms']} | {r['gflops']} |" for r in payload["gemm"]]
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--outstanding", default=40, show_default=True, help="Requests in flight (max_num_seqs is 32).")
@click.option("--warmup", default=20, show_default=True)
@click.option("--steps", default=200, show_default=True)
@click.option("--itl-target-ms", type=float, default=None, help="Default: the fixed 512-token budget.")
@click.option("--name", default="step_profile", show_default=True)
def main(engine_dir: Path, outstanding: int, warmup: int, steps: int, itl_target_ms: float | None, name: str) -> None:
    wait_quiet(click.echo)
    args = EngineArgs(max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=65536 // 16,
                      itl_target_ms=itl_target_ms)  # fmt: skip
    engine = LLMEngine(engine_dir, args)
    requests = iter(datasets.mixed(engine.tokenizer, 4 * outstanding + steps, seed=17))
    records = saturated_steps(engine, requests, outstanding, warmup, steps)
    decode_only = [r for r in records if r["prefill_tokens"] == 0]
    with_prefill = [r for r in records if r["prefill_tokens"] > 0]
    results = {
        "command": f"python -m benchmarks.step_profile --engine {engine_dir} --outstanding {outstanding} "
        f"--steps {steps}" + (f" --itl-target-ms {itl_target_ms:g}" if itl_target_ms else ""),
        "workload": f"benchmarks.datasets.mixed, {outstanding} requests in flight, greedy, EOS ignored, "
        f"32 sequences, 512-token steps, itl_target_ms {itl_target_ms}",
        "breakdown": {
            "all steps": breakdown(records),
            "decode-only steps": breakdown(decode_only),
            "steps with prefill": breakdown(with_prefill),
        },
        "gemm": gemm_efficiency(engine, [1, 8, 16, 32, 64, 128, 256, 512], repeats=30),
    }
    md, _ = write_report(name, results, render)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

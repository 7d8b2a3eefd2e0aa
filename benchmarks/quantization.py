"""Quantized engines side by side: quality (from each engine's gate report), size and speed.

    python -m benchmarks.quantization --engine fp32=engines/smollm2-135m \
        --engine int4-awq=engines/smollm2-135m-int4-awq --engine int4-rtn=... --engine fp8=...

Quality numbers are the ones the deploy gate measured at build time (held-out perplexity,
mean KL and top-1 agreement against the unquantized engine, known answers). Speed is decode
tok/s straight on the CPU backend (the serving path: segments + paged-attention kernel, and
the whole-graph session for a lone sequence), greedy, EOS ignored, single stream and a batch
of --batch sequences decoding together; medians of --repeats runs after a warm-up.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click

from benchmarks.report import write_results
from engine_format import EngineConfig, ceil_div
from executors import create_backend
from executors.base import EngineBackend
from executors.greedy import GreedyStep, greedy_generate, phase_seconds
from runtime.engine.tokenizer import encode_prompt, load_tokenizer

PROMPT = "Explain how a paged KV cache works in an LLM serving system."


def decode_tok_s(backend: EngineBackend, prompt: list[int], batch: int, new_tokens: int) -> float:
    """Prefill `batch` copies of the prompt (one call each), then time `new_tokens - 1` greedy
    decode steps of all of them together; -> output tokens per second of the decode phase."""
    steps: list[GreedyStep] = []
    greedy_generate(backend, [prompt] * batch, new_tokens, prefill_batch=1, max_batch_size=batch, on_step=steps.append)
    return batch * (new_tokens - 1) / phase_seconds(steps, "decode")


def engine_size_mb(engine_dir: Path) -> float:
    """The weights the engine loads (the external weights file plus the whole-graph ONNX)."""
    return sum((engine_dir / f).stat().st_size for f in ("model.onnx", "model.onnx.data")) / 2**20


def quality(engine_dir: Path) -> dict:
    path = engine_dir / "gate_report.json"
    if not path.is_file():
        return {}
    report = json.loads(path.read_text())
    m = report["metrics"]
    return {
        "gate": "passed" if report["passed"] else "FAILED",
        "perplexity": m["quantized_perplexity"],
        "reference_perplexity": m["reference_perplexity"],
        "mean_kl": m["mean_kl"],
        "top1_agreement": m["top1_agreement"],
        "answers": f"{m['quantized_correct']}/{m['questions']}",
        "reference_answers": f"{m['reference_correct']}/{m['questions']}",
    }


def _engines(values: tuple[str, ...]) -> dict[str, Path]:
    engines = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep or not Path(path, "manifest.json").is_file():
            message = f"expected LABEL=ENGINE_DIR with a built engine (got {value!r})"
            raise click.BadParameter(message, param_hint="--engine")
        engines[label] = Path(path)
    return engines


@click.command()
@click.option("--engine", "engine_args", multiple=True, required=True, help="LABEL=ENGINE_DIR, repeatable.")
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--batch", default=16, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(engine_args: tuple[str, ...], new_tokens: int, batch: int, repeats: int, threads: int) -> None:
    engines = _engines(engine_args)
    rows = {}
    for label, engine_dir in engines.items():
        config = EngineConfig.load(engine_dir)
        prompt = encode_prompt(load_tokenizer(engine_dir), PROMPT, chat=True)
        blocks = batch * ceil_div(len(prompt) + new_tokens, config.block_size)
        backend = create_backend(config, num_blocks=blocks, threads=threads, kind="cpu")
        speeds = {}
        for size in (1, batch):
            decode_tok_s(backend, prompt, size, 8)  # warm-up
            speeds[size] = [round(decode_tok_s(backend, prompt, size, new_tokens), 1) for _ in range(repeats)]
        rows[label] = {
            "engine": str(engine_dir),
            "quantization": config.quantization or "none",
            "size_mb": round(engine_size_mb(engine_dir), 1),
            "single_tok_s": statistics.median(speeds[1]),
            "batch_tok_s": statistics.median(speeds[batch]),
            "runs": {"single": speeds[1], f"batch {batch}": speeds[batch]},
            **quality(engine_dir),
        }
        click.echo(f"{label}: {rows[label]}", err=True)
    baseline = next(iter(rows.values()))
    lines = [
        f"Quantized engines: {len(prompt)}-token chat prompt, {new_tokens} new tokens (EOS ignored), greedy, "
        f"{threads} threads, CPU backend; decode tok/s medians of {repeats} runs. Quality from each engine's "
        "gate report (held-out text vs the unquantized engine).",
        "",
        f"| engine | gate | perplexity | mean KL | top-1 agreement | known answers | size MB | decode tok/s single "
        f"| vs {next(iter(rows))} | decode tok/s batch {batch} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        ppl = f"{r['perplexity']:.3f}" if "perplexity" in r else "–"
        kl = f"{r['mean_kl']:.4f}" if "mean_kl" in r else "–"
        top1 = f"{r['top1_agreement']:.3f}" if "top1_agreement" in r else "–"
        lines.append(
            f"| {label} | {r.get('gate', 'reference')} | {ppl} | {kl} | {top1} | {r.get('answers', '–')} "
            f"| {r['size_mb']} | {r['single_tok_s']} | {r['single_tok_s'] / baseline['single_tok_s']:.2f}x "
            f"| {r['batch_tok_s']} |"
        )
    reference_ppl = next((r["reference_perplexity"] for r in rows.values() if "reference_perplexity" in r), None)
    if reference_ppl:
        lines += ["", f"Unquantized reference perplexity on the same held-out text: {reference_ppl:.3f}."]
    results = {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "batch": batch, "threads": threads, "rows": rows}
    path = write_results("quantization", results, "\n".join(lines) + "\n")
    click.echo(path.read_text())


if __name__ == "__main__":
    main()

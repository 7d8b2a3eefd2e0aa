"""`python -m benchmarks.prompt_logprobs`: what scoring a prompt costs (SamplingParams.prompt_logprobs, the
OpenAI door's echo + logprobs), against the same prefill without it.

Offline, one request at a time through LLMEngine: a prompt of L random tokens, one generated token, prefix
caching off (so both compute every prompt token), greedy. Scored, each prefill chunk's every row comes back
as logits ([tokens, vocab] float32: 49,152 columns for SmolLM2) and each row is normalized on the host;
unscored, one row. Rounds alternate the two, so the machine's drift hits both; medians with min and max.

    python -m benchmarks.prompt_logprobs --engine engines/smollm2-135m [--lengths 512,1024,2048] [--rounds 3]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import numpy as np

from benchmarks.report import write_report
from executors.sampling import SamplingParams
from runtime.engine.engine_args import EngineArgs
from runtime.engine.llm_engine import LLMEngine


def prefill_seconds(engine: LLMEngine, prompt: list[int], scored: bool) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1 if scored else None)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--lengths", default="512,1024,2048", show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--backend", default=None, help="The engine's backend (default: the engine's default).")
def main(engine_dir: Path, lengths: str, rounds: int, backend: str | None) -> None:
    engine = LLMEngine(engine_dir, EngineArgs(backend=backend, enable_prefix_caching=False, itl_target_ms=None))
    vocab = engine.config.model.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for length in (int(n) for n in lengths.split(",")):
        prompt = rng.integers(3, vocab, length).tolist()
        prefill_seconds(engine, prompt, scored=True)  # warm: first-call allocations out of the timings
        times: dict[str, list[float]] = {"plain": [], "scored": []}
        for _ in range(rounds):
            for kind in ("plain", "scored"):
                times[kind].append(prefill_seconds(engine, prompt, kind == "scored"))
        row = {"tokens": length}
        for kind, seconds in times.items():
            rates = [length / s for s in seconds]
            row[kind] = {
                "tok_s": round(statistics.median(rates), 1),
                "min": round(min(rates), 1),
                "max": round(max(rates), 1),
            }
        row["scored_over_plain"] = round(row["scored"]["tok_s"] / row["plain"]["tok_s"], 3)
        rows.append(row)
        click.echo(
            f"{length:5d} tokens: plain {row['plain']['tok_s']} tok/s, scored {row['scored']['tok_s']} tok/s "
            f"({row['scored_over_plain']}x)"
        )
    command = f"python -m benchmarks.prompt_logprobs --engine {engine_dir} --lengths {lengths} --rounds {rounds}"
    if backend:
        command += f" --backend {backend}"
    write_report(
        "prompt_logprobs", {"command": command, "backend": type(engine.backend).__name__, "rows": rows}, render
    )


def render(payload: dict) -> str:
    lines = [
        "# Scoring a prompt (prompt_logprobs, echo + logprobs) against the same prefill without it",
        "",
        f"Machine: {payload.get('machine', '?')}",
        "",
        f"Command: `{payload['command']}`",
        "",
        "One request at a time, one generated token, prefix caching off. Prefill tokens per second, median of the "
        "alternating rounds (min-max).",
        "",
        "| prompt tokens | plain, tok/s | scored, tok/s | scored / plain |",
        "|---|---|---|---|",
    ]
    for r in payload["rows"]:
        plain, scored = r["plain"], r["scored"]
        lines.append(
            f"| {r['tokens']} | {plain['tok_s']} ({plain['min']}-{plain['max']}) | {scored['tok_s']} "
            f"({scored['min']}-{scored['max']}) | {r['scored_over_plain']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""Single-stream decode speed: trtserve ORT engine vs HF eager `generate`, same prompt.

    python -m benchmarks.single_stream --engine engines/smollm2-135m [--new-tokens 128] [--repeats 3]

Both run float32 on the CPU with the same thread count and generate exactly --new-tokens
tokens greedily (EOS ignored). Decode tok/s excludes the prefill (time to first token is
reported separately). Medians of --repeats runs, after one warm-up run each.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import torch

from benchmarks.report import write_results
from builder.sources import load_checkpoint, resolve_model
from engine_format import EngineConfig
from executors import create_backend
from executors.base import EngineBackend
from executors.greedy import GreedyStep, greedy_generate, phase_seconds
from runtime.engine.tokenizer import encode_prompt, load_tokenizer

PROMPT = "Explain how a paged KV cache works in an LLM serving system."


def time_engine(backend: EngineBackend, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(ttft_s, decode_s) for one greedy run straight on the backend: the prompt in one call,
    then `new_tokens - 1` decode steps (EOS ignored)."""
    steps: list[GreedyStep] = []
    greedy_generate(backend, [prompt], new_tokens, on_step=steps.append)
    return phase_seconds(steps, "prefill"), phase_seconds(steps, "decode")


def time_hf(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return ttft, total - ttft


def measure(fn, repeats: int) -> dict:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    ttfts, decodes = zip(*runs, strict=True)
    return {"ttft_s": [round(t, 4) for t in ttfts], "decode_s": [round(d, 4) for d in decodes]}


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path))
@click.option("--model", default="smollm2-135m", show_default=True, help="Source model for the HF baseline.")
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(engine_dir: Path, model: str, new_tokens: int, repeats: int, threads: int) -> None:
    torch.set_num_threads(threads)
    config = EngineConfig.load(engine_dir)
    prompt = encode_prompt(load_tokenizer(engine_dir), PROMPT, chat=True)
    backends = {kind: create_backend(config, config.max_blocks_per_seq, threads, kind) for kind in ("cpu", "graph")}
    hf_model, _ = load_checkpoint(resolve_model(model))
    rows = {
        "trtserve CPU backend (fp32; a lone sequence runs the whole-graph session)": measure(
            lambda: time_engine(backends["cpu"], prompt, new_tokens), repeats
        ),
        "trtserve graph backend: whole ONNX graph on ORT (fp32)": measure(
            lambda: time_engine(backends["graph"], prompt, new_tokens), repeats
        ),
        "HF transformers eager (fp32)": measure(lambda: time_hf(hf_model, prompt, new_tokens), repeats),
    }
    lines = [
        f"Single stream, {config.model.model_type} engine `{engine_dir}`, prompt {len(prompt)} tokens, "
        f"{new_tokens} new tokens (EOS ignored), {threads} threads, median of {repeats}.",
        "",
        "| engine | decode tok/s | TTFT ms | decode tok/s runs |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        speeds = [(new_tokens - 1) / d for d in row["decode_s"]]
        row["decode_tok_s_median"] = round(statistics.median(speeds), 1)
        row["ttft_ms_median"] = round(1000 * statistics.median(row["ttft_s"]), 1)
        lines.append(
            f"| {name} | {row['decode_tok_s_median']} | {row['ttft_ms_median']} | "
            f"{', '.join(f'{s:.1f}' for s in speeds)} |"
        )
    results = {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "threads": threads, "rows": rows}
    path = write_results("single_stream", results, "\n".join(lines) + "\n")
    click.echo(path.read_text())


if __name__ == "__main__":
    main()

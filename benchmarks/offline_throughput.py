"""Offline throughput: trtserve (in-flight batching, ORT CPU) vs HF eager, same prompts.

    python -m benchmarks.offline_throughput --engine engines/smollm2-135m-b64 \
        [--requests 64] [--input-len 256] [--output-len 128] [--hf-sequential-requests 4]

All requests arrive at t=0; every request generates exactly --output-len tokens (EOS
ignored), greedy, float32, 2 threads. Prompts are random token ids (seeded), so no prefix is
shared and prefix caching cannot help. Baselines: HF `generate` one request at a time
(measured on the first --hf-sequential-requests prompts: a sequential stream's rate does not
depend on how many follow it; TTFT for all 64 is extrapolated from it and marked so), and HF
static batching (batches of --hf-batch, left padding). TTFT counts from t=0, so it includes
queueing behind earlier requests/batches.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import numpy as np
import torch

from benchmarks import hf_baseline, metrics
from benchmarks.report import write_results
from builder.sources import load_checkpoint, resolve_model
from engine_format import EngineConfig, ceil_div
from runtime import EngineArgs, LLMEngine, SamplingParams


def percentiles(values: list[float]) -> dict[str, float]:
    p = metrics.percentiles(values)
    return {"p50_ms": round(p["p50"], 1), "p99_ms": round(p["p99"], 1)}


def run_trtserve(engine_dir: Path, prompts: list[list[int]], output_len: int, args: EngineArgs) -> dict:
    engine = LLMEngine(engine_dir, args)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(prompts[0][:8], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [d for d in engine.step() if d.finished]
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {
        "elapsed_s": round(elapsed, 2),
        "output_tok_s": round(len(prompts) * output_len / elapsed, 1),
        "ttft": percentiles([f.stats["ttft_s"] for f in finals]),
        "itl": percentiles([x for f in finals for x in f.stats["inter_token_latencies_s"]]),
        "preemptions": stats.preemptions,
        "steps": stats.steps,
    }


def run_hf(model, prompts: list[list[int]], output_len: int, batch: int) -> dict:
    """HF generate over `prompts` in batches of `batch` (left padding), one after another;
    TTFT counts from the first batch's start (queueing included)."""
    records, elapsed = hf_baseline.run(model, prompts, output_len, batch)
    t0 = records[0].start
    return {
        "elapsed_s": round(elapsed, 2),
        "output_tok_s": round(len(prompts) * output_len / elapsed, 1),
        "ttft": percentiles([r.chunk_times[0] - t0 for r in records]),
        "itl": percentiles([g for r in records for g in r.itls()]),
    }


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path))
@click.option("--model", default="smollm2-135m", show_default=True, help="Source model for the HF baselines.")
@click.option("--requests", default=64, show_default=True)
@click.option("--input-len", default=256, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option("--max-num-seqs", default=64, show_default=True)
@click.option("--max-num-batched-tokens", default=512, show_default=True)
@click.option("--kv-blocks", default=None, type=int, help="KV pool blocks (default: enough for all requests).")
@click.option("--hf-batch", default=16, show_default=True)
@click.option("--hf-sequential-requests", default=4, show_default=True)
@click.option("--skip-hf", is_flag=True, help="Only run trtserve (for quick tuning).")
@click.option("--threads", default=2, show_default=True)
def main(engine_dir, model, requests, input_len, output_len, max_num_seqs, max_num_batched_tokens, kv_blocks,
         hf_batch, hf_sequential_requests, skip_hf, threads) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    config = EngineConfig.load(engine_dir)
    prompts = [rng.integers(3, config.model.vocab_size, input_len).tolist() for _ in range(requests)]
    per_seq_blocks = ceil_div(input_len + output_len, config.block_size)
    args = EngineArgs(
        num_kv_blocks=kv_blocks or requests * per_seq_blocks + 8,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        threads=threads,
    )
    rows = {f"trtserve (max_num_seqs {max_num_seqs})": run_trtserve(engine_dir, prompts, output_len, args)}
    if not skip_hf:
        hf_model, _ = load_checkpoint(resolve_model(model))
        run_hf(hf_model, prompts[:1], 4, 1)  # warm-up
        seq = run_hf(hf_model, prompts[:hf_sequential_requests], output_len, 1)
        per_request = seq["elapsed_s"] / hf_sequential_requests
        seq["note"] = f"measured on {hf_sequential_requests} requests; TTFT for {requests} extrapolated"
        seq["ttft"] = percentiles([per_request * i + seq["ttft"]["p50_ms"] / 1000 for i in range(requests)])
        rows["HF eager sequential"] = seq
        rows[f"HF eager static batch {hf_batch}"] = run_hf(hf_model, prompts, output_len, hf_batch)
    base = rows.get("HF eager sequential", {}).get("output_tok_s")
    lines = [
        f"Offline throughput: {requests} requests x {input_len} prompt tokens -> {output_len} output tokens "
        f"(EOS ignored, greedy, fp32), all arriving at t=0; {threads} threads; engine `{engine_dir}`.",
        "",
        "| system | output tok/s | vs HF sequential | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        ratio = f"{r['output_tok_s'] / base:.1f}x" if base else "-"
        lines.append(
            f"| {name} | {r['output_tok_s']} | {ratio} | {r['ttft']['p50_ms']:.0f} / {r['ttft']['p99_ms']:.0f} | "
            f"{r['itl']['p50_ms']:.1f} / {r['itl']['p99_ms']:.1f} |"
        )
    results = {"requests": requests, "input_len": input_len, "output_len": output_len, "rows": rows,
               "engine_args": args.__dict__}  # fmt: skip
    path = write_results("offline_throughput", results, "\n".join(lines) + "\n")
    click.echo(path.read_text())


if __name__ == "__main__":
    main()

"""KV-cache quantization: fp32 vs int8 vs fp8 pools (engine_format/kv_cache.py) on SmolLM2-135M shapes.

    python -m benchmarks.kv_quant                       # kernel timings + capacity (a minute)
    python -m benchmarks.kv_quant --serve fp32=engines/smollm2-135m --serve int8=engines/smollm2-135m-kv8

- attention ms per decode step: the CPU paged-attention kernel (runtime/backends/kernels/) over a
  pool of `batch` sequences of `context` tokens, one layer timed, x num_layers (every layer reads a
  pool of the same size); plus the quantizing write of the step's new rows (KVPool.write);
- the largest concurrency at max_seq_len that fits in a KV budget (default 1 GiB), scales included;
- with --serve: output tok/s through Triton at concurrency 32 with 1,500-token prompts, one
  server per engine (benchmarks.servers / benchmarks.client, the serving benchmark's helpers).
The gate's numbers are each engine's gate_report.json (build time), not re-measured here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import click
import numpy as np

from benchmarks.report import write_results
from engine_format import EngineConfig, ModelSpec
from runtime.backends.cpu_attention import AttentionShape, paged_attention
from runtime.backends.kv_pool import KVPool, blocks_for_budget
from runtime.backends.kv_quant import KVQuant, encode_fp8, quantize_int8

SMOLLM2 = ModelSpec("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, True, False, "default", 8192, (None,) * 30, 1, (2,))
KINDS = ("fp32", "int8", "fp8")
KV_DTYPE = {"fp32": "auto", "int8": "int8", "fp8": "fp8"}


def _config(kind: str, max_seq_len: int) -> EngineConfig:
    config = EngineConfig(Path("."), "onnxruntime-cpu", "float32", 64, 32, max_seq_len, SMOLLM2)
    scales = ((0.01, 0.01),) * SMOLLM2.num_layers if kind == "fp8" else None
    return dataclasses.replace(config, kv_cache_dtype=KV_DTYPE[kind], kv_scales=scales)


def attention_ms(kind: str, batch: int, context: int, repeats: int, threads: int | None) -> dict[str, float]:
    """Median ms of one layer's decode attention and of its quantizing write, both x num_layers."""
    spec, bs = SMOLLM2, 64
    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, bs)
    per_seq = -(-context // bs)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((batch * per_seq * bs, spec.kv_width), dtype=np.float32)
    if kind == "int8":
        codes, scales = quantize_int8(values, spec.num_kv_heads)
        caches = [codes.reshape(-1, bs, spec.kv_width)] * 2
        row_scales = scales.reshape(-1, bs, spec.num_kv_heads)
        quant: KVQuant | None = KVQuant("int8", row_scales, row_scales)
    elif kind == "fp8":
        caches = [encode_fp8(values, 0.01).reshape(-1, bs, spec.kv_width)] * 2
        quant = KVQuant("fp8", k_scale=0.01, v_scale=0.01)
    else:
        caches, quant = [values.reshape(-1, bs, spec.kv_width)] * 2, None
    tables = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int64)
    q = rng.standard_normal((batch, spec.num_heads * spec.head_dim), dtype=np.float32)
    seqs, positions = np.arange(batch, dtype=np.int64), np.full(batch, context - 1, np.int64)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        paged_attention(q, caches[0], caches[1], tables, seqs, positions, shape, threads=threads, quant=quant)
        times.append(time.perf_counter() - start)
    pool = KVPool.allocate(_config(kind, context), 2 * batch)
    slots = np.arange(batch, dtype=np.int64) * bs
    rows = rng.standard_normal((batch, spec.kv_width), dtype=np.float32)
    writes = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        pool.write(0, slots, rows, rows)
        writes.append(time.perf_counter() - start)
    layers = spec.num_layers
    return {
        "attention_ms": 1e3 * layers * statistics.median(times[1:]),
        "write_ms": 1e3 * layers * statistics.median(writes[1:]),
    }


def capacity(budget_bytes: int, max_seq_len: int) -> dict[str, dict[str, float]]:
    out = {}
    for kind in KINDS:
        config = _config(kind, max_seq_len)
        blocks = blocks_for_budget(config, budget_bytes)
        out[kind] = {"blocks": blocks, "tokens": blocks * 64, "max_concurrency": blocks * 64 / max_seq_len}
    return out


def serve_tok_s(engine: Path, concurrency: int, prompt_len: int, output_len: int, count: int) -> float:
    """Output tok/s through Triton (the serving benchmark's server and client)."""
    from benchmarks import client, datasets, servers
    from runtime.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine)
    requests = datasets.fixed(tokenizer, count, prompt_len, output_len)
    warmup = datasets.fixed(tokenizer, 2, prompt_len, 8, seed=1)
    settings = servers.ServingSettings(max_num_seqs=concurrency, kv_tokens=concurrency * (prompt_len + output_len))
    with servers.trtserve(engine, settings) as endpoint:
        result = client.run(endpoint, requests, warmup, concurrency=concurrency)
    return sum(r.output_tokens for r in result.records) / result.duration_s


@click.command()
@click.option("--batch", default=32, show_default=True)
@click.option("--context", "contexts", multiple=True, type=int, default=(1024, 2048), show_default=True)
@click.option("--repeats", default=5, show_default=True)
@click.option("--threads", type=int, help="Kernel threads (default: all usable cores).")
@click.option("--budget-gib", default=1.0, show_default=True)
@click.option("--max-seq-len", default=2048, show_default=True)
@click.option("--serve", "serve", multiple=True, metavar="NAME=ENGINE", help="Serving run per engine (slow).")
@click.option("--serve-requests", default=64, show_default=True)
def main(batch, contexts, repeats, threads, budget_gib, max_seq_len, serve, serve_requests) -> None:
    kernel = {f"{kind}@{ctx}": attention_ms(kind, batch, ctx, repeats, threads) for ctx in contexts for kind in KINDS}
    cap = capacity(int(budget_gib * 2**30), max_seq_len)
    serving = {}
    for item in serve:
        name, engine = item.split("=", 1)
        serving[name] = serve_tok_s(Path(engine), 32, 1500, 128, serve_requests)
    lines = [f"# KV-cache quantization (SmolLM2-135M shapes, batch {batch}, decode)", "",
             "| kv dtype | context | attention ms/step (30 layers) | speed-up vs fp32 | write ms/step |",
             "|---|---|---|---|---|"]  # fmt: skip
    for ctx in contexts:
        base = kernel[f"fp32@{ctx}"]["attention_ms"]
        for kind in KINDS:
            k = kernel[f"{kind}@{ctx}"]
            lines.append(f"| {kind} | {ctx} | {k['attention_ms']:.1f} | {base / k['attention_ms']:.2f}x | "
                         f"{k['write_ms']:.2f} |")  # fmt: skip
    lines += ["", f"Capacity in {budget_gib:g} GiB at max_seq_len {max_seq_len}:", "",
              "| kv dtype | blocks | tokens | max concurrency |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {k} | {c['blocks']} | {c['tokens']} | {c['max_concurrency']:.1f} |" for k, c in cap.items()]
    if serving:
        lines += ["", "Serving, concurrency 32, 1,500-token prompts, 128 output tokens:", ""]
        lines += [f"- {name}: {tok_s:.1f} output tok/s" for name, tok_s in serving.items()]
    path = write_results("kv_quant", {"kernel": kernel, "capacity": cap, "serving_tok_s": serving}, "\n".join(lines))
    click.echo("\n".join(lines))
    click.echo(f"\nwritten: {path}")


if __name__ == "__main__":
    main()

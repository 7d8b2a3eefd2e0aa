"""KV-cache quantization: fp32 vs int8 vs fp8 pools (engine_format/kv_cache.py) on SmolLM2-135M shapes.

    python -m benchmarks.kv_quant                       # kernel timings + capacity (a few minutes)
    python -m benchmarks.kv_quant --baseline-kernel old/_paged_attention.so   # + an older kernel build
    python -m benchmarks.kv_quant --serve fp32=engines/smollm2-135m --serve int8=engines/smollm2-135m-kv8

- attention ms per decode step: the CPU paged-attention kernel (executors/kernels/) over a
  pool of `batch` sequences of `context` tokens (K and V separate arrays, blocks in random order),
  one layer timed, x num_layers (every layer reads a pool of the same size). Variants: the kernel's
  AVX-512 loops, its portable loops (simd=False) and, with --baseline-kernel, a build of an older
  kernel (ABI 2: before the AVX-512 loops). All variants x dtypes run interleaved, one call each per
  round, so a change in machine load hits them alike; median, min and max over the rounds;
- the quantizing write of a decode step's new rows: KVPool.write (one C call per layer) vs
  KVPool.write_numpy (the numpy reference), interleaved the same way;
- the largest concurrency at max_seq_len that fits in a KV budget (default 1 GiB), scales included;
- with --serve: output tok/s through Triton at concurrency 32 with 1,500-token prompts, one
  server per engine, one after the other, --serve-rounds times in alternating order
  (benchmarks.servers / benchmarks.client).
The gate's numbers are each engine's gate_report.json (build time), not re-measured here.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import numpy as np

from benchmarks.report import cpu_busy_fraction, write_results
from engine_format import EngineConfig, ModelSpec
from executors import cpu_attention
from executors.cpu_attention import AttentionShape, paged_attention
from executors.kv_pool import KVPool, blocks_for_budget
from executors.kv_quant import KVQuant, encode_fp8, quantize_int8

SMOLLM2 = ModelSpec("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, True, False, "default", 8192, (None,) * 30, 1, (2,))
KINDS = ("fp32", "int8", "fp8")
KV_DTYPE = {"fp32": "auto", "int8": "int8", "fp8": "fp8"}
FP8_SCALE = 0.01  # the pool's values are standard normal: |x| / 0.01 saturates only beyond 4.48


def _config(kind: str, max_seq_len: int) -> EngineConfig:
    config = EngineConfig(Path("."), "onnxruntime-cpu", "float32", 64, 32, max_seq_len, SMOLLM2)
    scales = ((FP8_SCALE, FP8_SCALE),) * SMOLLM2.num_layers if kind == "fp8" else None
    return dataclasses.replace(config, kv_cache_dtype=KV_DTYPE[kind], kv_scales=scales)


class _Abi2Kernel:
    """An older build of the kernel (ABI 2: no `simd` argument) behind the current call."""

    def __init__(self, path: Path) -> None:
        loader = importlib.machinery.ExtensionFileLoader("_paged_attention", str(path))
        spec = importlib.util.spec_from_file_location("_paged_attention", path, loader=loader)
        assert spec is not None
        self.module: ModuleType = importlib.util.module_from_spec(spec)
        loader.exec_module(self.module)
        if getattr(self.module, "ABI", 1) != 2:
            raise click.BadParameter(f"{path} is not an ABI-2 build of the kernel")

    def paged_attention(self, *args: Any) -> None:
        self.module.paged_attention(*args[:-1])


@contextmanager
def _kernel(module: object | None) -> Iterator[None]:
    """Run cpu_attention.paged_attention on another build of the C kernel (None: the installed one)."""
    installed = cpu_attention._paged_attention
    if module is not None:
        cpu_attention._paged_attention = module
    try:
        yield
    finally:
        cpu_attention._paged_attention = installed


def _pool(
    kind: str, values: tuple[np.ndarray, np.ndarray], bs: int
) -> tuple[tuple[np.ndarray, np.ndarray], KVQuant | None]:
    """(K, V caches [blocks, bs, kv_width] in `kind`, how the kernel reads them)."""
    spec = SMOLLM2
    k, v = values
    if kind == "int8":
        (kc, ks), (vc, vs) = (quantize_int8(x, spec.num_kv_heads) for x in (k, v))
        quant = KVQuant("int8", ks.reshape(-1, bs, spec.num_kv_heads), vs.reshape(-1, bs, spec.num_kv_heads))
        return (kc.reshape(-1, bs, spec.kv_width), vc.reshape(-1, bs, spec.kv_width)), quant
    if kind == "fp8":
        k, v = (encode_fp8(x, FP8_SCALE) for x in (k, v))
        quant = KVQuant("fp8", k_scale=FP8_SCALE, v_scale=FP8_SCALE)
        return (k.reshape(-1, bs, spec.kv_width), v.reshape(-1, bs, spec.kv_width)), quant
    return (k.reshape(-1, bs, spec.kv_width), v.reshape(-1, bs, spec.kv_width)), None


def _summary(ms: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "samples": [round(x, 2) for x in ms]}


def attention_ms(
    batch: int, context: int, repeats: int, threads: int | None, baseline: _Abi2Kernel | None
) -> dict[str, dict[str, dict[str, Any]]]:
    """{kind: {impl: ms per decode step x num_layers (median/min/max)}} for one context; impl is
    simd, portable, baseline (with --baseline-kernel), write_c and write_numpy."""
    spec, bs = SMOLLM2, 64
    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, bs)
    per_seq = -(-context // bs)
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((batch * per_seq * bs, spec.kv_width), dtype=np.float32) for _ in "kv")
    pools = {kind: _pool(kind, (k, v), bs) for kind in KINDS}
    del k, v
    tables = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int64)
    q = rng.standard_normal((batch, spec.num_heads * spec.head_dim), dtype=np.float32)
    seqs, positions = np.arange(batch, dtype=np.int64), np.full(batch, context - 1, np.int64)
    out = np.empty_like(q)

    def attend(kind: str, simd: bool, module: object | None) -> Callable[[], None]:
        (k_cache, v_cache), quant = pools[kind]

        def call() -> None:
            with _kernel(module):
                paged_attention(q, k_cache, v_cache, tables, seqs, positions, shape, out=out, threads=threads,
                                quant=quant, simd=simd)  # fmt: skip

        return call

    def write(pool: KVPool, numpy: bool) -> Callable[[], None]:
        return lambda: (pool.write_numpy if numpy else pool.write)(0, slots, rows, rows)

    write_pools = {kind: KVPool.allocate(_config(kind, context), 2 * batch) for kind in KINDS}
    slots = np.arange(batch, dtype=np.int64) * bs
    rows = rng.standard_normal((batch, spec.kv_width), dtype=np.float32)
    calls: dict[tuple[str, str], Callable[[], None]] = {}
    for kind in KINDS:
        calls[kind, "simd"] = attend(kind, True, None)
        calls[kind, "portable"] = attend(kind, False, None)
        if baseline is not None:
            calls[kind, "baseline"] = attend(kind, True, baseline)
        calls[kind, "write_c"] = write(write_pools[kind], numpy=False)
        calls[kind, "write_numpy"] = write(write_pools[kind], numpy=True)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for round_ in range(repeats + 1):  # round 0 warms up (page faults, caches) and is dropped
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            if round_:
                times[key].append(1e3 * spec.num_layers * (time.perf_counter() - start))
    result: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in KINDS}
    for (kind, impl), ms in times.items():
        result[kind][impl] = _summary(ms)
    return result


def capacity(budget_bytes: int, max_seq_len: int) -> dict[str, dict[str, float]]:
    out = {}
    for kind in KINDS:
        config = _config(kind, max_seq_len)
        blocks = blocks_for_budget(config, budget_bytes)
        out[kind] = {"blocks": blocks, "tokens": blocks * 64, "max_concurrency": blocks * 64 / max_seq_len}
    return out


def serve_tok_s(engine: Path, concurrency: int, prompt_len: int, output_len: int, count: int) -> dict[str, Any]:
    """Output tok/s through Triton (the serving benchmark's server and client)."""
    from benchmarks import client, datasets, servers
    from runtime.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine)
    requests = datasets.fixed(tokenizer, count, prompt_len, output_len)
    warmup = datasets.fixed(tokenizer, 2, prompt_len, 8, seed=1)
    settings = servers.ServingSettings(max_num_seqs=concurrency, kv_tokens=concurrency * (prompt_len + output_len))
    busy = cpu_busy_fraction()
    with servers.trtserve(engine, settings) as endpoint:
        result = client.run(endpoint, requests, warmup, concurrency=concurrency)
    tokens = sum(r.output_tokens for r in result.records)
    return {"output_tok_s": tokens / result.duration_s, "duration_s": result.duration_s, "busy_before": busy}


def _percent(fraction: float | None) -> str:
    return "unknown" if fraction is None else f"{fraction:.0%}"


def _row(label: str, stats: dict[str, Any], base: float | None) -> str:
    speedup = f"{base / stats['median']:.2f}x" if base else "-"
    return f"| {label} | {stats['median']:.1f} | {stats['min']:.1f} | {stats['max']:.1f} | {speedup} |"


@click.command()
@click.option("--batch", default=32, show_default=True)
@click.option("--context", "contexts", multiple=True, type=int, default=(1024, 2048), show_default=True)
@click.option("--repeats", default=7, show_default=True, help="Measured rounds (>= 5 for the spread).")
@click.option("--threads", type=int, help="Kernel threads (default: all usable cores).")
@click.option("--baseline-kernel", type=click.Path(exists=True, path_type=Path),
              help="An ABI-2 build of paged_attention.c (e.g. git show HEAD~1:...) timed beside this one.")  # fmt: skip
@click.option("--budget-gib", default=1.0, show_default=True)
@click.option("--max-seq-len", default=2048, show_default=True)
@click.option("--serve", "serve", multiple=True, metavar="NAME=ENGINE", help="Serving run per engine (slow).")
@click.option("--serve-requests", default=64, show_default=True)
@click.option("--serve-rounds", default=1, show_default=True, help="Runs per engine, order reversed each round.")
def main(
    batch: int,
    contexts: tuple[int, ...],
    repeats: int,
    threads: int | None,
    baseline_kernel: Path | None,
    budget_gib: float,
    max_seq_len: int,
    serve: tuple[str, ...],
    serve_requests: int,
    serve_rounds: int,
) -> None:
    baseline = _Abi2Kernel(baseline_kernel) if baseline_kernel else None
    busy = cpu_busy_fraction()
    kernel = {str(ctx): attention_ms(batch, ctx, repeats, threads, baseline) for ctx in contexts}
    cap = capacity(int(budget_gib * 2**30), max_seq_len)
    engines = [tuple(item.split("=", 1)) for item in serve]
    serving: dict[str, dict[str, Any]] = {name: {"engine": engine, "runs": []} for name, engine in engines}
    for round_ in range(serve_rounds if engines else 0):  # A B, then B A, ...: drift in load hits both alike
        for name, engine in engines if round_ % 2 == 0 else engines[::-1]:
            run = serve_tok_s(Path(engine), 32, 1500, 128, serve_requests)
            serving[name]["runs"].append({"round": round_, **run})
    for entry in serving.values():
        entry["output_tok_s"] = statistics.mean(r["output_tok_s"] for r in entry["runs"])
    impls = {"simd": "AVX-512 loops", "portable": "portable loops", "baseline": "before (HEAD kernel build)"}
    lines = [f"# KV-cache quantization (SmolLM2-135M shapes, batch {batch}, decode)", "",
             f"Attention ms per decode step (one layer x {SMOLLM2.num_layers}), {repeats} interleaved rounds, "
             f"threads {threads or 'all'}; machine busy {_percent(busy)} at start (other work shares the cores: "
             "compare rows of one table, not runs).", ""]  # fmt: skip
    for ctx, by_kind in kernel.items():
        lines += [f"## context {ctx}", "", "| kv dtype, kernel | median | min | max | speed-up vs fp32 (same loops) |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for impl, label in impls.items():
            if impl not in by_kind["fp32"]:
                continue
            base = by_kind["fp32"][impl]["median"]
            lines += [_row(f"{kind}, {label}", by_kind[kind][impl], base) for kind in KINDS]
        lines += ["", "| quantizing write, per step | median | min | max | speed-up vs numpy |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for kind in KINDS[1:]:
            numpy_ms = by_kind[kind]["write_numpy"]["median"]
            lines += [_row(f"{kind}, C (KVPool.write)", by_kind[kind]["write_c"], numpy_ms),
                      _row(f"{kind}, numpy (KVPool.write_numpy)", by_kind[kind]["write_numpy"], None)]  # fmt: skip
        lines.append("")
    lines += [f"Capacity in {budget_gib:g} GiB at max_seq_len {max_seq_len}:", "",
              "| kv dtype | blocks | tokens | max concurrency |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {k} | {c['blocks']} | {c['tokens']} | {c['max_concurrency']:.1f} |" for k, c in cap.items()]
    if serving:
        lines += ["", "Serving, concurrency 32, 1,500-token prompts, 128 output tokens, "
                  f"{serve_requests} requests, one server after the other ({serve_rounds} rounds, order "
                  "reversed each round):", ""]  # fmt: skip
        for name, entry in serving.items():
            runs = "; ".join(f"round {r['round']}: {r['output_tok_s']:.1f} tok/s in {r['duration_s']:.0f} s, machine "
                             f"busy {_percent(r['busy_before'])} before" for r in entry["runs"])  # fmt: skip
            lines.append(f"- {name} ({entry['engine']}): mean {entry['output_tok_s']:.1f} output tok/s ({runs})")
    results = {"batch": batch, "repeats": repeats, "threads": threads, "busy_at_start": busy, "kernel": kernel,
               "capacity": cap, "serving": serving}  # fmt: skip
    path = write_results("kv_quant", results, "\n".join(lines) + "\n")
    click.echo("\n".join(lines))
    click.echo(f"\nwritten: {path}")


if __name__ == "__main__":
    main()

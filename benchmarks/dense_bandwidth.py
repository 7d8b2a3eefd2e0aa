"""`python -m benchmarks.dense_bandwidth`: how close the cpu-bf16 backend's dense layers run to this
machine's memory bandwidth, and what torch's weight-only int8 / int4 CPU kernels would change (issue 17).

In process, no engine step: one decoder layer's matmuls (QKV, o_proj, gate | up, down, with the
engine's shapes) at --rows rows, chained over every layer's own random weights, so each step streams
all of them from memory as a real step does; and the same chain over one layer's weights repeated, which
stay in cache (the compute floor). Formats: bf16 reordered for oneDNN (as `cpu-bf16` runs them),
`_weight_int8pack_mm` (int8, a scale per output channel) and `_weight_int4pack_mm_for_cpu` (int4,
groups of 32). Next to it, the bandwidth of a plain streaming read (a sum over 400 MB) with one thread
and with all. Effective bandwidth = the chain's weight bytes / its time. Writes results/<name>.{json,md}.

    python -m benchmarks.dense_bandwidth --engine /work/engines/v3/smollm2-135m-b32
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

import executors.torch_cpu  # noqa: F401 - sets the OpenMP spin policy before torch loads libgomp
from benchmarks.cpu import wait_quiet
from benchmarks.report import write_report
from engine_format import EngineConfig
from executors.cpus import usable_cpus

import torch  # isort: skip - after the backend module (one libgomp, its policy)

INT4_GROUP = 32
STREAM_BYTES = 400_000_000


def median_ms(run: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    run()  # warm (oneDNN JITs its kernels on first use)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), min(times), max(times)


def stream_gbps(threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    data = torch.ones(STREAM_BYTES // 4, dtype=torch.float32)
    ms, _, _ = median_ms(data.sum, repeats)
    return STREAM_BYTES / ms / 1e6


def layer_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's matmuls: fused QKV, o_proj, gate | up, down."""
    m = config.model
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return [(q + 2 * kv, m.hidden_size), (m.hidden_size, q), (2 * m.intermediate_size, m.hidden_size),
            (m.hidden_size, m.intermediate_size)]  # fmt: skip


def formats(rows: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (pack a float [out, in] weight, run x [rows, in] bf16 against the packed weight)."""

    def pack_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w.abs().amax(1) / 127
        return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(torch.bfloat16)

    def pack_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, inp = w.shape
        groups = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-6)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(out, inp)
        # the kernel computes (code - 8) * scale + zero
        scales_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), scales_zeros

    return {
        "bf16, oneDNN reordered (cpu-bf16)": (
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), rows),
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        ),
        "int8 weight-only (_weight_int8pack_mm)": (
            pack_int8, lambda x, w: torch.ops.aten._weight_int8pack_mm(x, *w)),
        f"int4 weight-only, group {INT4_GROUP} (_weight_int4pack_mm_for_cpu)": (
            pack_int4, lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], INT4_GROUP, w[1])),
    }  # fmt: skip


def chain_ms(config: EngineConfig, rows: int, repeats: int) -> list[dict]:
    shapes, layers = layer_shapes(config), config.model.num_layers
    inputs = {size: torch.randn(rows, size, dtype=torch.bfloat16) for size in {i for _, i in shapes}}
    weight_bytes = 2 * layers * sum(o * i for o, i in shapes)  # at bf16; int8 / int4 read 1/2, 1/4 of it
    results = []
    for name, (pack, run) in formats(rows).items():
        generator = torch.Generator().manual_seed(0)
        packed = [[pack(torch.randn(o, i, generator=generator) * 0.05) for o, i in shapes] for _ in range(layers)]
        for placement, weights in (("from memory", packed), ("one layer's, cached", [packed[0]] * layers)):

            def chain(weights: list = weights, run: Callable = run) -> None:
                for layer in weights:
                    for w, (_, inp) in zip(layer, shapes, strict=True):
                        run(inputs[inp], w)

            ms, low, high = median_ms(chain, repeats)
            results.append({"format": name, "weights": placement, "ms": round(ms, 2), "min": round(low, 2),
                            "max": round(high, 2), "bf16_gbps": round(weight_bytes / ms / 1e6, 1)})  # fmt: skip
    return results


def render(p: dict) -> str:
    lines = [
        "# Dense layers against memory bandwidth", "", f"Command: `{p['command']}`", "",
        f"Streaming read (sum over {STREAM_BYTES // 1_000_000} MB): {p['stream_gbps']['1']} GB/s with 1 thread, "
        f"{p['stream_gbps'][str(p['threads'])]} GB/s with {p['threads']}.", "",
        f"One step's matmul chain: {p['layers']} layers x {p['shapes']} at {p['rows']} rows, {p['threads']} threads, "
        f"{p['bf16_mb']} MB of bf16 weights; median (min-max) of {p['repeats']}. 'bf16-equivalent GB/s' is the "
        "bf16 weight bytes over the time, for comparison across formats.", "",
        "| format | weights | ms | bf16-equivalent GB/s |", "|---|---|---|---|",
    ]  # fmt: skip
    for r in p["chain"]:
        lines.append(f"| {r['format']} | {r['weights']} | {r['ms']} ({r['min']}–{r['max']}) | {r['bf16_gbps']} |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--rows", default=32, show_default=True, type=click.IntRange(1), help="Matmul rows (decodes).")
@click.option("--repeats", default=15, show_default=True, type=click.IntRange(1))
@click.option("--name", default="dense_bandwidth", show_default=True)
def main(engine: Path, rows: int, repeats: int, name: str) -> None:
    wait_quiet(click.echo)
    config, threads = EngineConfig.load(engine), usable_cpus()
    stream = {str(t): round(stream_gbps(t, repeats), 1) for t in sorted({1, threads})}
    torch.set_num_threads(threads)
    shapes = layer_shapes(config)
    payload = {
        "command": "python -m benchmarks.dense_bandwidth " + shlex.join(sys.argv[1:]),
        "engine": str(engine), "rows": rows, "repeats": repeats, "threads": threads,
        "layers": config.model.num_layers, "shapes": shapes, "stream_gbps": stream,
        "bf16_mb": round(2 * config.model.num_layers * sum(o * i for o, i in shapes) / 1e6, 1),
        "chain": chain_ms(config, rows, repeats),
    }  # fmt: skip
    md, _ = write_report(name, payload, render)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

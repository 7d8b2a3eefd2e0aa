"""`python -m benchmarks.lora_kernel --out FILE`: the multi-LoRA SGMV kernels' cost next to the projection they ride on.

Times plugins_cuda/lora.py's `lora_apply` (shrink + expand, 8 resident adapter slots, segments from `segments_of`)
against the base projection x @ W of the same [tokens, H_in] x [H_in, H_out] (torch, bfloat16) on a CUDA device,
for the fused qkv of SmolLM2-135M (576 -> 960) and Llama-3.2-1B (2048 -> 3072) at ranks 16 and 64, over three
batches: 64 decode rows over 8 adapters (segments of one row, BGMV-like), 256 decode rows, and a prefill of
4 chunks x 512 tokens over 4 adapters. Reports per case the median µs of each and their ratio (the LoRA overhead),
timed twice: plain launches (triton.testing.do_bench, L2 flushed: the launcher's Python included where the GPU
outruns it) and CUDA-graph replays (do_bench_cudagraph: how the torch backend's decode steps run), plus the
update's error against a float32 torch reference (bfloat16 has not been checked anywhere else). Part `lora` of
`python -m benchmarks.gpu`, sized for under a minute on an H100 (16 kernel compiles, 48 timings; not yet run on
one). `--device cpu` runs tiny float32 shapes under Triton's interpreter: the plumbing, in seconds; those timings
mean nothing, and the JSON says so.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import torch

SLOTS = 8
RANKS = (16, 64)


@dataclass(frozen=True)
class Sizes:
    shapes: dict[str, tuple[int, int]]  # the fused qkv: H_in -> H_out
    decode_rows: tuple[int, ...]
    prefill: tuple[int, int]  # chunks x tokens, one adapter each

    def batches(self) -> dict[str, list[int]]:
        """Each token's slot: decode rows cycle through the adapters (every segment one row), prefill chunks
        one adapter each."""
        chunks, length = self.prefill
        cases = {f"decode-{rows}": [row % SLOTS for row in range(rows)] for rows in self.decode_rows}
        cases[f"prefill-{chunks}x{length}"] = [chunk for chunk in range(chunks) for _ in range(length)]
        return cases


GPU = Sizes({"smollm2-135m": (576, 960), "llama-3.2-1b": (2048, 3072)}, (64, 256), (4, 512))
TINY = Sizes({"tiny": (64, 96)}, (8, 16), (2, 24))  # --device cpu


def _cpu_median_s(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def timers(device: str, repeats: int) -> dict[str, Callable[[Callable[[], Any]], float]]:
    """Per mode, a function giving the median µs of one call."""
    if device == "cpu":
        return {"plain": lambda fn: 1e6 * _cpu_median_s(fn, repeats)}
    import triton.testing  # type: ignore[import-untyped]

    return {
        "plain": lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"),
        "graph": lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"),
    }


def reference_update(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, starts: list[int], slots: list[int]
) -> torch.Tensor:
    """The LoRA update [T, H_out] in float32, segment by segment."""
    import torch

    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for first, end, slot in zip(starts[:-1], starts[1:], slots, strict=True):
        if slot >= 0:
            rows = x[first:end].float()
            out[first:end] = float(scaling[slot]) * ((rows @ a[slot].float().T) @ b[slot].float().T)
    return out


def measure(device: str, repeats: int) -> dict:
    import torch

    from plugins_cuda.lora import lora_apply, segments_of

    cpu = device == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise click.UsageError("no CUDA device: run with --device cpu")
    dtype = torch.float32 if cpu else torch.bfloat16  # the interpreter's tl.dot reads bfloat16 as raw bits
    sizes = TINY if cpu else GPU
    timed = timers(device, repeats)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for model, (hidden_in, hidden_out) in sizes.shapes.items():
        w = torch.randn(hidden_in, hidden_out, generator=gen, device=device, dtype=dtype) / hidden_in**0.5
        for rank in RANKS:
            a = torch.randn(SLOTS, rank, hidden_in, generator=gen, device=device, dtype=dtype) / hidden_in**0.5
            b = torch.randn(SLOTS, hidden_out, rank, generator=gen, device=device, dtype=dtype) / rank**0.5
            scaling = torch.full((SLOTS,), 2.0, dtype=torch.float32, device=device)  # alpha / r
            for batch, slot_list in sizes.batches().items():
                tokens = len(slot_list)
                x = torch.randn(tokens, hidden_in, generator=gen, device=device, dtype=dtype)
                starts, slots = segments_of(torch.tensor(slot_list, dtype=torch.int32, device=device))
                bounds = starts.tolist()
                longest = max(end - first for first, end in pairwise(bounds))
                y = x @ w
                lora = partial(lora_apply, x, y, a, b, scaling, starts, slots, max_segment_len=longest)  # no sync
                base = partial(torch.matmul, x, w)
                got = y.clone()
                lora_apply(x, got, a, b, scaling, starts, slots, max_segment_len=longest)
                want = reference_update(x, a, b, scaling, bounds, slots.tolist())
                error = float(((got.float() - y.float()) - want).abs().max() / want.abs().max())
                row: dict[str, Any] = {
                    "model": model,
                    "h_in": hidden_in,
                    "h_out": hidden_out,
                    "rank": rank,
                    "batch": batch,
                    "tokens": tokens,
                    "segments": len(bounds) - 1,
                    "error": float(f"{error:.2e}"),  # max |update - reference| / max |reference|
                }
                for mode, timer in timed.items():
                    lora_us, base_us = timer(lora), timer(base)
                    ratio = round(lora_us / base_us, 3)
                    row[mode] = {"lora_us": round(lora_us, 2), "base_us": round(base_us, 2), "ratio": ratio}
                rows.append(row)
    result: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "slots": SLOTS,
        "timings_meaningful": not cpu,
        "note": (
            "Triton's interpreter on the CPU at toy shapes: the plumbing only, the timings mean nothing"
            if cpu
            else "median µs per call; ratio = lora_us / base_us, the LoRA's cost on top of the projection"
        ),
        "rows": rows,
    }
    if not cpu:
        result["gpu"] = torch.cuda.get_device_name(device)
    return result


@click.command()
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True)
@click.option("--device", default="cuda", show_default=True, help="cuda, cuda:N or cpu (Triton's interpreter)")
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(min=1), help="timed calls on the CPU")
def main(out: Path, device: str, repeats: int) -> None:
    if device == "cpu":
        from plugins_cuda.interpreter import interpreter_problem

        if problem := interpreter_problem():
            raise click.UsageError(problem)
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (its jit reads it)
    result = measure(device, repeats)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["rows"]:
        times = ", ".join(
            f"{mode} {row[mode]['lora_us']} vs {row[mode]['base_us']} µs (x{row[mode]['ratio']})"
            for mode in ("plain", "graph")
            if mode in row
        )
        click.echo(f"{device} {row['model']} r{row['rank']} {row['batch']}: {times}; error {row['error']}")


if __name__ == "__main__":
    main()

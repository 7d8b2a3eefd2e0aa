"""`python -m plugins_cuda.graph_check`: the attention launches under real CUDA-graph capture
and replay, at the benchmark's shapes, in one process (GPU only).

Why: the decode sweep died under triton.testing.do_bench_cudagraph with "an illegal memory
access" at its second shape while plain launches passed; graph replays are how the torch
backend runs decode steps. This captures every shape of the sweep first (each after an
eager warm-up on a side stream, as do_bench_cudagraph and executors/torch/graphs.py do),
then replays all graphs, newest first, synchronizing after each so a fault names its shape,
and compares each replay with the eager output. Both launchers: `launch_ragged` (the torch
backend) and `paged_attention_padded` (the TensorRT plugin pair). One K/V pool serves every
shape, as one serves every graph in the backend. Progress goes to stdout and --out/graph_check.json
after every step, so a crash still leaves the last good step on record. For the exact faulting
access: `compute-sanitizer --tool memcheck python -m plugins_cuda.graph_check --quick`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setup:
    heads: int = 32  # Llama-3-8B, bf16, block size 16
    kv_heads: int = 8
    head_dim: int = 128
    block: int = 16
    device: str = "cuda"
    dtype: str = "bfloat16"


FULL = [(b, c) for c in (512, 4096, 32768) for b in (1, 8, 32, 128, 256) if b * c <= 2**21]
QUICK = [(1, 512), (8, 512), (1, 4096), (32, 4096), (4, 32768)]
DRY = Setup(8, 2, 32, 16, "cpu", "float32")  # --dry-run: the interpreter on CPU, a stand-in graph
DRY_SHAPES = [(1, 40), (3, 1100), (8, 70)]


def _inputs(s: Setup, pool_blocks: int, batch: int, rows: int, context: int, torch):
    per_seq = -(-context // s.block)
    tables = torch.randperm(pool_blocks, device=s.device)[: batch * per_seq].view(batch, per_seq)
    q = torch.randn(batch * rows, s.heads * s.head_dim, device=s.device, dtype=getattr(torch, s.dtype))
    positions = (torch.arange(context - rows, context, device=s.device)).repeat(batch)
    query_start = torch.arange(0, batch * rows + 1, rows, device=s.device, dtype=torch.int32)
    return q, tables, positions, query_start


def _launchers(s: Setup, k, v, q, tables, positions, query_start, batch: int, rows: int):
    from plugins_cuda.attention_launch import launch_ragged, paged_attention_padded

    padded_q, padded_pos = q.view(batch, rows, -1), positions.view(batch, rows)
    sms = {"sm_count": 4} if s.device == "cpu" else {}  # a small GPU on CPU: small batches split
    return {
        "ragged": lambda: launch_ragged(q, k, v, tables, positions, query_start, rows, s.kv_heads, **sms),
        "padded": lambda: paged_attention_padded(
            padded_q, k, v, tables, padded_pos, s.kv_heads, s.head_dim**-0.5, **sms
        ),
    }


def capture(fn, torch, dry: bool = False):
    """do_bench_cudagraph's sequence: eager warm-up on a side stream, then capture there (dry:
    plugins_cuda.graph_record.FakeGraph on CPU)."""
    if dry:
        from plugins_cuda.graph_record import FakeGraph

        fn()
        graph = FakeGraph()
        with graph.capture():
            out = fn()
        return graph, out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins_cuda.graph_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 decode shapes and one prefill (the gpu test)")
    parser.add_argument("--launcher", choices=("ragged", "padded", "both"), default="both")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the interpreter and a stand-in graph, tiny shapes")
    parser.add_argument("--out", type=Path, default=Path("kernel-check"))
    args = parser.parse_args(argv)
    if args.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("plugins_cuda.graph_check needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    s = DRY if args.dry_run else Setup()
    shapes = [(b, c, 1) for b, c in (DRY_SHAPES if args.dry_run else QUICK if args.quick else FULL)]
    shapes.append((1, 50 if args.dry_run else 512 if args.quick else 2048, 0))
    pool_blocks = max(b * -(-c // s.block) for b, c, _ in shapes) + 1
    k, v = (torch.randn(pool_blocks, s.block, s.kv_heads * s.head_dim, device=s.device,
                        dtype=getattr(torch, s.dtype)) for _ in "kv")  # fmt: skip
    sync = torch.cuda.synchronize if s.device == "cuda" else lambda: None
    launchers = ("ragged", "padded") if args.launcher == "both" else (args.launcher,)
    args.out.mkdir(parents=True, exist_ok=True)
    log: list[dict] = []

    def note(entry: dict) -> None:
        log.append(entry)
        print(json.dumps(entry), flush=True)
        (args.out / "graph_check.json").write_text(json.dumps(log, indent=1) + "\n")

    graphs = []
    for batch, context, decode in shapes:
        rows = 1 if decode else context  # a prefill: one sequence's whole prompt
        q, tables, positions, query_start = _inputs(s, pool_blocks, batch, rows, context, torch)
        for name, fn in _launchers(s, k, v, q, tables, positions, query_start, batch, rows).items():
            if name not in launchers:
                continue
            eager = fn().clone()
            sync()
            graph, out = capture(fn, torch, args.dry_run)
            sync()
            graphs.append((name, batch, context, graph, out, eager, (q, tables, positions, query_start)))
            note({"captured": name, "batch": batch, "context": context, "rows": rows})
    bad = 0
    for name, batch, context, graph, out, eager, _ in reversed(graphs):
        for _ in range(1 if args.dry_run else 3):
            graph.replay()
        sync()
        error = float((out.float() - eager.float()).abs().max())
        bad += error > 1e-3
        note({"replayed": name, "batch": batch, "context": context, "max_error_vs_eager": error})
    note({"done": True, "graphs": len(graphs), "mismatches": bad})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

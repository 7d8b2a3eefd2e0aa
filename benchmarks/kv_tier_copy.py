"""`python -m benchmarks.kv_tier_copy --out FILE`: how fast whole KV blocks move between a pool and the host tier.

The KV tiers (runtime/engine/kv_tiers/) copy blocks with executors/kv_blocks.py's gather (pool -> host payload
rows) and scatter (rows -> pool). This times both on a pool of SmolLM2-135M's KV shape (30 layers, K and V, 16-token
blocks, 3 KV heads x 64) for batches of 1, 16 and 128 blocks: on a CUDA device (bfloat16, over PCIe or NVLink-C2C),
or on the CPU (float32 numpy, the CPU backends' pool) with `--device cpu`. Reports GB/s (payload bytes / median
time of `--repeats`). Part of `python -m benchmarks.gpu` on a GPU; on the CPU it runs anywhere.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from executors.kv_blocks import gather_blocks, scatter_blocks

SHAPE = (30, 2, 16, 192)  # layers, K|V, block_size, kv_width: SmolLM2-135M
BATCHES = (1, 16, 128)


def _median_s(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(device: str, pool_blocks: int, repeats: int) -> dict:
    layers, kv, block_size, width = SHAPE
    if device == "cpu":
        pool: Any = np.zeros((layers, kv, pool_blocks, block_size, width), np.float32)
        pool[...] = 1.0  # commit the pages

        def sync() -> None:
            return None

        dtype = "float32"
    else:
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("no CUDA device: run with --device cpu")
        pool = torch.ones((layers, kv, pool_blocks, block_size, width), dtype=torch.bfloat16, device=device)
        sync, dtype = torch.cuda.synchronize, "bfloat16"
    rng = np.random.default_rng(0)
    rows = []
    for n in BATCHES:
        ids = rng.choice(pool_blocks, size=n, replace=False).tolist()
        payload = gather_blocks(pool, ids)
        gather_s = _median_s(lambda ids=ids: gather_blocks(pool, ids), repeats, sync)
        scatter_s = _median_s(lambda ids=ids, p=payload: scatter_blocks(pool, ids, p), repeats, sync)
        nbytes = payload.nbytes
        rows.append(
            {
                "blocks": n,
                "bytes": nbytes,
                "gather_ms": round(gather_s * 1e3, 3),
                "scatter_ms": round(scatter_s * 1e3, 3),
                "gather_gb_s": round(nbytes / gather_s / 1e9, 2),
                "scatter_gb_s": round(nbytes / scatter_s / 1e9, 2),
            }
        )
    return {"device": device, "dtype": dtype, "shape": list(SHAPE), "pool_blocks": pool_blocks, "rows": rows}


@click.command()
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True)
@click.option("--device", default="cuda", show_default=True, help="cuda, cuda:N or cpu")
@click.option("--pool-blocks", default=1024, show_default=True, type=click.IntRange(min=max(BATCHES)))
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(min=1))
def main(out: Path, device: str, pool_blocks: int, repeats: int) -> None:
    result = measure(device, pool_blocks, repeats)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["rows"]:
        gather, scatter = row["gather_gb_s"], row["scatter_gb_s"]
        click.echo(f"{device} {row['blocks']:>4} blocks: gather {gather} GB/s, scatter {scatter} GB/s")


if __name__ == "__main__":
    main()

"""`python -m benchmarks.pack_rows`: a decode step's packing (executors/torch/model.py's HostStep.pack) through the
persistent batch's rows against packing every chunk's table, by batch and context length.

The rows are copied only when a table changes, so a steady decode step's packing no longer grows with
batch x blocks; this times that part alone (no engine, no device): B decode chunks at a context of L tokens,
their tables unchanged since the last step (as between block boundaries), median of `--repetitions` packs.

    python -m benchmarks.pack_rows [--batches 64,256] [--contexts 256,2048] [--block-size 16]
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import click

from benchmarks.report import write_report
from executors.base import SequenceChunk
from executors.block_table_rows import BlockTableRows
from executors.torch.model import HostStep


@dataclasses.dataclass(frozen=True)
class _Config:  # the EngineConfig fields HostStep.pack reads
    block_size: int
    max_seq_len: int
    model: object


@dataclasses.dataclass(frozen=True)
class _Model:
    vocab_size: int = 50_000


def time_pack(batch: int, context: int, block_size: int, repetitions: int) -> dict:
    width = context // block_size + 1
    config = _Config(block_size, width * block_size, _Model())
    num_blocks = batch * width
    chunks = [SequenceChunk([7], context - 1, list(range(b * width, (b + 1) * width)), 1, b) for b in range(batch)]
    rows = BlockTableRows(batch, width)
    result = {"batch": batch, "context": context}
    for name, use in (("every_table_us", None), ("rows_us", rows)):
        HostStep.pack(chunks, config, num_blocks, rows=use)  # type: ignore[arg-type]  # (the rows filled once)
        seconds = []
        for _ in range(repetitions):
            start = time.perf_counter()
            HostStep.pack(chunks, config, num_blocks, rows=use)  # type: ignore[arg-type]
            seconds.append(time.perf_counter() - start)
        result[name] = round(statistics.median(seconds) * 1e6, 1)
    return result


@click.command()
@click.option("--batches", default="64,256", show_default=True)
@click.option("--contexts", default="256,2048", show_default=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--repetitions", default=50, show_default=True)
def main(batches: str, contexts: str, block_size: int, repetitions: int) -> None:
    rows = [time_pack(int(b), int(c), block_size, repetitions) for b in batches.split(",") for c in contexts.split(",")]
    for r in rows:
        click.echo(
            f"batch {r['batch']:4d} context {r['context']:5d}: every table {r['every_table_us']} us, "
            f"rows {r['rows_us']} us"
        )
    command = f"python -m benchmarks.pack_rows --batches {batches} --contexts {contexts} --block-size {block_size}"
    write_report("pack_rows", {"command": command, "rows": rows}, render)


def render(payload: dict) -> str:
    lines = [
        "# A decode step's packing: persistent rows against every table",
        "",
        f"Machine: {payload.get('machine', '?')}",
        "",
        f"Command: `{payload['command']}`",
        "",
        "| batch | context | every table, µs | persistent rows, µs |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['batch']} | {r['context']} | {r['every_table_us']} | {r['rows_us']} |" for r in payload["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

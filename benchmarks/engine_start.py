"""`python -m benchmarks.engine_start`: what an engine's start costs, by part, and the KV pool's commit before/after.

A supervisor's restart waits for this: a new tritonserver loads the model, whose start builds the engine
(`LLMEngine`: the backend's weights and kernels, the KV pool, the tokenizer). Each round starts the engine
in a fresh process, once committing the pool as before (numpy's fill, page by page) and once as now (the
kernel's MAP_POPULATE), in alternating order, and times the whole start and the pool's allocation.

    python -m benchmarks.engine_start --engine engines/smollm2-135m-b32 [--num-kv-blocks N] [--rounds 3]

Results: results/engine-start.{json,md}.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMITS = ("fill", "populate")


def worker(engine_dir: str, commit: str, num_kv_blocks: int | None) -> dict:
    """Seconds of LLM(engine) and of its KV pool's allocation, the pool committed by `commit`."""
    import numpy as np
    import numpy.typing

    import executors.kv_pool as kv_pool

    if commit == "fill":

        def committed_by_fill(shape: tuple[int, ...], dtype: np.typing.DTypeLike) -> np.ndarray:
            pool = np.empty(shape, dtype)
            pool.fill(0)
            return pool

        kv_pool.committed_zeros = committed_by_fill
    spent = [0.0]
    allocate = kv_pool.allocate_pool

    def timed(*args: object, **kwargs: object) -> np.ndarray:
        start = time.perf_counter()
        try:
            return allocate(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    kv_pool.allocate_pool = timed
    from runtime import LLM

    start = time.perf_counter()
    args = {"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {}
    llm = LLM(engine_dir, **args)
    total = time.perf_counter() - start
    return {"start_s": total, "pool_s": spent[0], "pool_blocks": llm.engine.kv.pool.num_blocks}


def _run(engine: Path, commit: str, num_kv_blocks: int | None) -> dict:
    command = [sys.executable, "-m", "benchmarks.engine_start", "worker", str(engine), commit, str(num_kv_blocks or 0)]
    out = subprocess.run(
        command, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(results: dict) -> str:
    machine = results["machine"]
    lines = [
        "# Engine start: the KV pool's commit, numpy's fill against MAP_POPULATE",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores; {results['date_utc']}. Command: `{results['command']}`",
        "",
        f"`LLM(engine)` in a fresh process per round and way ({results['rounds']} rounds, alternating), "
        f"pool of {results['pool_blocks']} blocks ({results['pool_gib']:.2f} GiB).",
        "",
        "| pool commit | engine start s, median (min-max) | pool allocation s, median (min-max) |",
        "|---|---|---|",
    ]
    for commit in COMMITS:
        runs = results["runs"][commit]
        cells = []
        for key in ("start_s", "pool_s"):
            values = [r[key] for r in runs]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {commit} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    import click

    from benchmarks import report
    from engine_format import EngineConfig
    from engine_format.kv_cache import bytes_per_token

    if argv[:1] == ["worker"]:
        engine, commit, blocks = argv[1], argv[2], int(argv[3])
        print(json.dumps(worker(engine, commit, blocks or None)))
        return

    @click.command()
    @click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
    @click.option("--num-kv-blocks", type=int, default=None, help="The pool's size (default: the engine's).")
    @click.option("--rounds", type=int, default=3, show_default=True)
    def cli(engine: Path, num_kv_blocks: int | None, rounds: int) -> None:
        runs: dict[str, list[dict]] = {commit: [] for commit in COMMITS}
        for i in range(rounds):
            for commit in COMMITS if i % 2 == 0 else reversed(COMMITS):
                runs[commit].append(_run(engine, commit, num_kv_blocks))
                click.echo(f"round {i}: {commit} {runs[commit][-1]}", err=True)
        config = EngineConfig.load(engine)
        blocks = runs["populate"][0]["pool_blocks"]
        gib = blocks * config.block_size * bytes_per_token(config.model, config.dtype, config.kv_cache_dtype) / 2**30
        command = "python -m benchmarks.engine_start " + " ".join(sys.argv[1:])
        results = {"command": command, "rounds": rounds, "runs": runs, "pool_blocks": blocks, "pool_gib": gib}
        path, _ = report.write_report("engine-start", results, render)
        click.echo(f"wrote {path}", err=True)

    cli.main(argv, standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])

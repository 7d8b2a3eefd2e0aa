"""`python -m benchmarks.host_step_ab`: the offline step's host cost, text included, against an older commit.

`LLMEngine.step()` (what `LLM.generate` drives: schedule, the backend, the update, then detokenization and
stop strings) over a backend that computes nothing and returns random token ids, as a new user would try
it: the engine's own tokenizer (SmolLM2's for a SmolLM2 engine), 200-token prompts, temperature 0.7 /
top-p 0.9, one stop string, EOS ignored. B requests decode together; the steady decode steps are timed
and reported as µs per request-step. The same measurement runs over the code of `--baseline` (a commit,
exported with `git archive` into a temporary directory) in alternating rounds in one run, each round a
fresh process per code and batch, so the two share the machine's state.

    python -m benchmarks.host_step_ab --engine engines/smollm2-135m-b256 [--baseline ed039d9]
                                      [--batches 1,64,256] [--steps 48] [--rounds 3]

The engine's max batch size must cover the largest batch (build one with --max-batch-size 256); the
backend never reads its weights. The worker (`python benchmarks/host_step_ab.py worker ...`) imports only
what both codes provide, from whichever tree is first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_TOKENS = 200
FIRST_TEXT_TOKEN = 17  # SmolLM2's special tokens are ids 0-16: random output stays text
STOP = "\n\n\n\n\n"  # one stop string, rarely (if ever) produced by random tokens


def worker(
    engine_dir: str, batch: int, steps: int, backend: str = "null", prompt_tokens: int = PROMPT_TOKENS, seed: int = 0
) -> dict:
    """Seconds of each steady decode step of `batch` requests through `LLMEngine.step()`, in this process's code,
    and of the backend's calls within each. `backend`: "null" (random tokens, nothing computed) or "torch" (the
    torch backend with its kernels removed: benchmarks.host_overhead's, from the same code)."""
    import numpy as np

    from engine_format import EngineConfig
    from runtime.engine.engine_args import EngineArgs
    from runtime.engine.llm_engine import LLMEngine

    # The older layout first: the project's editable install puts this tree's `executors` on the path too.
    try:  # before the executors package (ed039d9)
        from runtime.backends import DeviceSample  # type: ignore[attr-defined]
        from runtime.engine.sampling_params import SamplingParams  # type: ignore[import-not-found]
    except ImportError:  # this wave's layout
        from executors.sampling import DeviceSample, SamplingParams

    config = EngineConfig.load(engine_dir)
    vocab = config.model.vocab_size
    rng = np.random.default_rng(seed)

    class RandomTokens:
        """A backend that computes nothing: each sampled row gets a random text token at once."""

        def __init__(self, num_blocks: int) -> None:
            self.config, self.num_blocks = config, num_blocks

        def step(self, chunks):
            return np.zeros((sum(c.num_logits for c in chunks), vocab), np.float32)

        def step_sample(self, chunks, rows):
            tokens = rng.integers(FIRST_TEXT_TOKEN, vocab, len(chunks))
            tokens[[i for i, row in enumerate(rows) if row is None]] = -1
            return DeviceSample(tokens, [None] * len(chunks))

    max_tokens, blocks, engine_args = decode_run_sizes(batch, steps, prompt_tokens, config.block_size)
    args = EngineArgs(**engine_args)
    if backend == "torch":
        from benchmarks.host_overhead import torch_without_kernels

        engine = LLMEngine(engine_dir, args, backend=torch_without_kernels(config, blocks, batch))
    else:
        engine = LLMEngine(engine_dir, args, backend=RandomTokens(blocks))
    in_backend = [0.0]
    for name in ("step", "step_sample", "launch"):  # each entry point timed on the instance
        method = getattr(engine.backend, name, None)
        if method is not None:
            setattr(engine.backend, name, _timed(method, in_backend))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, stop=(STOP,), ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(FIRST_TEXT_TOKEN, vocab, prompt_tokens).tolist(), params)
    while any(r.num_computed_tokens < len(r.all_token_ids) - 1 for r in engine.requests.values()):
        engine.step()  # the prefills, then every request decoding
    seconds, backend_s = [], []
    for _ in range(steps):
        in_backend[0] = 0.0
        start = time.perf_counter()
        outputs = engine.step()
        seconds.append(time.perf_counter() - start)
        backend_s.append(in_backend[0])
        assert len(outputs) == batch, f"{len(outputs)} outputs for {batch} decoding requests"
    return {"batch": batch, "step_s": seconds, "backend_s": backend_s}


def decode_run_sizes(batch: int, steps: int, prompt_tokens: int, block_size: int) -> tuple[int, int, dict]:
    """(max_tokens, KV blocks, EngineArgs fields) of a run that times `steps` steps of `batch` decoding requests:
    requests admitted first decode while later prompts prefill (8,192 tokens a step), so max_tokens leaves them
    room, and the pool holds every request at its longest."""
    max_tokens = steps + 64
    blocks = batch * (prompt_tokens + max_tokens) // block_size + 2 * batch
    fields = dict(
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, batch),
        num_kv_blocks=blocks,
        itl_target_ms=None,
        max_waiting=batch,
    )
    return max_tokens, blocks, fields


def _timed(method, total: list[float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    return timed


def _run_worker(tree: Path, engine_dir: Path, batch: int, steps: int, backend: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = str(Path(__file__).resolve())
    command = [sys.executable, "-P", script, "worker", str(engine_dir.resolve()), str(batch), str(steps), backend]
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def export_commit(commit: str, into: Path) -> Path:
    """The commit's files (no .git): the worker needs no built extension (its backend runs no kernel)."""
    root = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit], cwd=root, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv: list[str]) -> None:
    import click

    @click.command()
    @click.option(
        "--engine",
        "engine_dir",
        type=click.Path(path_type=Path, exists=True, file_okay=False),
        default=None,
        help="An engine whose max batch size covers the largest batch (default with --backend torch: the tiny "
        "model, built; its KV pool is allocated for real).",
    )
    @click.option("--baseline", default="ed039d9", show_default=True, help="The commit to compare with.")
    @click.option("--backend", type=click.Choice(["null", "torch"]), default="null", show_default=True)
    @click.option("--batches", default="1,64,256", show_default=True)
    @click.option("--steps", default=48, show_default=True, type=click.IntRange(8))
    @click.option("--rounds", default=3, show_default=True, type=click.IntRange(1))
    @click.option("--output", default=None, help="Report name (default host_step_ab[-torch]).")
    def run(
        engine_dir: Path | None, baseline: str, backend: str, batches: str, steps: int, rounds: int, output: str | None
    ) -> None:
        from benchmarks.host_overhead import engine_with_batch
        from benchmarks.report import write_report

        sizes = [int(b) for b in batches.split(",")]
        here = Path(__file__).resolve().parent.parent
        samples: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (µs per request-step, backend's share)
        with tempfile.TemporaryDirectory() as tmp:
            if engine_dir is None:
                if backend != "torch":
                    raise click.UsageError("--engine is required with --backend null (SmolLM2's tokenizer, say)")
                engine_dir = engine_with_batch(max(sizes), Path(tmp))
            trees = {"baseline": export_commit(baseline, Path(tmp) / "baseline"), "current": here}
            for round_ in range(rounds):
                for batch in sizes:
                    for code in ("baseline", "current") if round_ % 2 == 0 else ("current", "baseline"):
                        result = _run_worker(trees[code], engine_dir, batch, steps, backend)
                        us = statistics.median(result["step_s"]) * 1e6 / batch
                        backend_us = statistics.median(result["backend_s"]) * 1e6 / batch
                        samples.setdefault((code, batch), []).append((us, backend_us))
                        click.echo(
                            f"round {round_ + 1} batch {batch:4d} {code:8s}: {us:8.2f} us per request-step "
                            f"({backend_us:.2f} in the backend)"
                        )
        rows = []
        for batch in sizes:
            old, new = samples[("baseline", batch)], samples[("current", batch)]
            ratios = [n[0] / o[0] for n, o in zip(new, old, strict=True)]
            rows.append(
                {
                    "batch": batch,
                    "baseline_us": [round(x, 2) for x, _ in old],
                    "current_us": [round(x, 2) for x, _ in new],
                    "baseline_backend_us": [round(b, 2) for _, b in old],
                    "current_backend_us": [round(b, 2) for _, b in new],
                    "ratio_median": round(statistics.median(ratios), 3),
                    "ratio_min": round(min(ratios), 3),
                    "ratio_max": round(max(ratios), 3),
                }
            )
        command = (
            f"python -m benchmarks.host_step_ab --backend {backend} --baseline {baseline} --batches {batches} "
            f"--steps {steps} --rounds {rounds}" + (f" --engine {engine_dir}" if backend == "null" else "")
        )
        payload = {"command": command, "baseline": baseline, "backend": backend, "rows": rows}
        write_report(output or ("host_step_ab" if backend == "null" else f"host_step_ab-{backend}"), payload, render)

    run.main(argv, standalone_mode=True)


def render(payload: dict) -> str:
    base = payload["baseline"]
    what = (
        "a backend that returns random token ids at once"
        if payload.get("backend", "null") == "null"
        else "the torch backend on the CPU with its kernels removed (benchmarks/host_overhead.py)"
    )
    lines = [
        "# The offline step's host cost, text included: this code against an older commit",
        "",
        f"Machine: {payload.get('machine', '?')}",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"`LLMEngine.step()` over {what}: 200-token prompts, temperature 0.7 / top-p 0.9, one stop string, "
        "steady decode steps. µs per request-step, the median of each round (rounds alternate which code "
        "runs first), and of it the time inside the backend's calls.",
        "",
        f"| batch | {base}: µs per request-step (in the backend) | this code | this / {base} (median, min-max) |",
        "|---|---|---|---|",
    ]
    for r in payload["rows"]:
        old = ", ".join(f"{t} ({b})" for t, b in zip(r["baseline_us"], r.get("baseline_backend_us", []), strict=False))
        new = ", ".join(f"{t} ({b})" for t, b in zip(r["current_us"], r.get("current_backend_us", []), strict=False))
        lines.append(f"| {r['batch']} | {old} | {new} | {r['ratio_median']} ({r['ratio_min']}-{r['ratio_max']}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        engine, batch, steps, backend = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(json.dumps(worker(engine, batch, steps, backend)))
    else:
        main(sys.argv[1:])

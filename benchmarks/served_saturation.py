"""`python -m benchmarks.served_saturation`: an engine kept saturated through tritonserver, at steady state.

The mixed chat workload (benchmarks.datasets.mixed) closed-loop with --concurrency requests in flight
(32 sequences run, so prompts always wait), through tritonserver with benchmarks.mixed's settings. Output
tok/s, the mean step and the engine's busy fraction come from the server's /metrics over a window that
starts --window-start seconds after the load and lasts --window seconds, so neither the ramp nor the
drain counts (benchmarks.mixed's output tok/s includes its drain). Configurations: responses streamed a
token at a time, 4 tokens at a time (the server's stream_interval) or whole (one response per request:
what the per-token responses cost), speculation off or n-gram; each in its own server, alternated
--repetitions times. Compare with
benchmarks.saturated_engine, the same loop in process with no server.

    python -m benchmarks.served_saturation --engine /work/engines/v3/kv-int8 --backend cpu-bf16
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click

from benchmarks import client, datasets, prometheus, servers
from benchmarks.cpu import alternate
from benchmarks.mixed import TrtserveRun
from benchmarks.report import configurations_report, median_cell, write_configurations
from runtime.engine.tokenizer import load_tokenizer

CONFIGS = {  # label -> (streamed, n-gram speculation, stream interval)
    "streamed": (True, False, 1),
    "streamed/4": (True, False, 4),
    "whole": (False, False, 1),
    "streamed+ngram": (True, True, 1),
}


@dataclass(frozen=True)
class Sample:
    """The engine's cumulative counters at one moment, from its /metrics."""

    time_s: float
    generation_tokens: float
    step_seconds: float
    steps: float

    @classmethod
    def scrape(cls, metrics_url: str) -> Sample:
        m = prometheus.fetch(metrics_url)
        return cls(time.monotonic(), prometheus.total(m, "trtserve_generation_tokens_total"),
                   prometheus.total(m, "trtserve_step_duration_seconds_sum"),
                   prometheus.total(m, "trtserve_step_duration_seconds_count"))  # fmt: skip


def steady_state(before: Sample, after: Sample) -> dict[str, float]:
    """Output tok/s, ms per step, busy fraction and output tokens per step between two samples."""
    wall, steps = after.time_s - before.time_s, after.steps - before.steps
    if wall <= 0 or steps <= 0:
        raise ValueError(f"no steps in the window ({steps:g} steps over {wall:.1f} s): the load did not run")
    tokens, busy = after.generation_tokens - before.generation_tokens, after.step_seconds - before.step_seconds
    return {"output_tok_s": tokens / wall, "ms_per_step": 1000 * busy / steps, "busy": busy / wall,
            "tokens_per_step": tokens / steps}  # fmt: skip


def run_config(engine_dir: Path, backend: str, streamed: bool, ngram: bool, stream_interval: int, concurrency: int,
               window_start_s: float, window_s: float) -> dict[str, float]:  # fmt: skip
    """One configuration in a server of its own."""
    run = TrtserveRun(engine_dir, backend, ngram)
    settings = servers.ServingSettings(extra_params=run.params, stream_interval=stream_interval)
    tokenizer = load_tokenizer(engine_dir)
    # More requests than the window can finish: the loop stays closed at `concurrency` throughout.
    work = datasets.mixed(tokenizer, 2000, seed=5)
    warm = datasets.mixed(tokenizer, 2, seed=99, answer_range=(8, 8))
    with servers.trtserve(engine_dir, settings) as endpoint:
        client.run(endpoint, warm, [], concurrency=2)
        load_endpoint = endpoint if streamed else replace(endpoint, kind="triton-whole")
        load = threading.Thread(target=client.run, args=(load_endpoint, work, []),
                                kwargs={"concurrency": concurrency}, daemon=True)  # fmt: skip
        load.start()
        time.sleep(window_start_s)
        before = Sample.scrape(endpoint.metrics_url or "")
        time.sleep(window_s)
        after = Sample.scrape(endpoint.metrics_url or "")
    load.join(timeout=60)  # the server is gone: its remaining requests fail at once
    return steady_state(before, after)


def render(p: dict) -> str:
    return configurations_report(
        p, "An engine kept saturated through tritonserver: steady-state output tok/s",
        "its own server. `whole`: one response per request instead of one per token; `/4`: one per 4 tokens",
        [("ms per step", median_cell("ms_per_step", 1)), ("engine busy", median_cell("busy", 3)),
         ("output tokens per step", median_cell("tokens_per_step", 1))],
    )  # fmt: skip


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--backend", default="cpu-bf16", show_default=True)
@click.option("--configs", default=",".join(CONFIGS), show_default=True,
              help=f"Configurations to compare, the first the baseline: {', '.join(CONFIGS)}.")  # fmt: skip
@click.option("--concurrency", default=40, show_default=True, help="Requests in flight (32 sequences run).")
@click.option("--window-start", default=12.0, show_default=True, help="Seconds of load before the window.")
@click.option("--window", default=30.0, show_default=True, help="Seconds measured.")
@click.option("--repetitions", default=2, show_default=True, type=click.IntRange(1))
@click.option("--name", default="served_saturation", show_default=True)
def main(engine_dir: Path, backend: str, configs: str, concurrency: int, window_start: float, window: float,
         repetitions: int, name: str) -> None:  # fmt: skip
    labels = [c for c in configs.split(",") if c]
    unknown = set(labels) - set(CONFIGS)
    if unknown:
        raise click.BadParameter(f"unknown {sorted(unknown)}; choose from {', '.join(CONFIGS)}", param_hint="--configs")
    configurations = {label: functools.partial(run_config, engine_dir, backend, *CONFIGS[label], concurrency,
                                               window_start, window) for label in labels}  # fmt: skip
    runs = alternate(configurations, repetitions, lambda s: click.echo(s, err=True))
    command = (f"python -m benchmarks.served_saturation --engine {engine_dir} --backend {backend} --configs {configs} "
               f"--concurrency {concurrency} --window-start {window_start:g} --window {window:g} "
               f"--repetitions {repetitions}")  # fmt: skip
    workload = (f"benchmarks.datasets.mixed closed-loop, {concurrency} requests in flight, greedy, EOS ignored; "
                f"32 sequences, 512-token steps, prefix caching on, backend {backend}; /metrics over {window:g} s from "
                f"{window_start:g} s after the load started")  # fmt: skip
    md = write_configurations(name, command, workload, runs, repetitions, render)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

"""`python -m benchmarks.slo`: issue 16's SLO-aware step budget -> results/slo.{json,md} + PNGs.

One run, three servers in turn, the same prompts and arrival times for each:
- trtserve with the fixed step budget (`itl_target_ms` "0": every step takes up to 512 tokens, so a
  prefill chunk stalls every decode in its step),
- trtserve with the SLO budget (`itl_target_ms` empty: the engine's default target, 200 ms),
- vLLM's OpenAI server (chunked prefill, 512-token steps) in each of --vllm-dtypes (fp32: like for like with
  trtserve's fp32 engine; bf16: vLLM's fastest where the CPU has AMX), where benchmarks/.venvs/vllm exists.
Workloads: the suite's fixed workload (500 -> 128 tokens, EOS ignored) in a closed loop at
concurrency 8/16/32 (2 x concurrency requests), and chat prompts (EOS honoured, <= 128 tokens) with
Poisson arrivals at two rates near saturation: given (--rates), or fractions of the chat throughput
the fixed-budget server reaches in a closed loop at concurrency 16 (measured first, in this run).
Goodput: requests/s meeting TTFT <= 2 s and TPOT <= 200 ms (benchmarks/metrics.py).

    python -m benchmarks.slo --engine /work/engines/smollm2-135m-b32
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np

from benchmarks import client, datasets, servers
from benchmarks.cpu import wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import RequestRecord, summarize
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_report
from benchmarks.slo_report import (
    CURVE_Q,
    FIXED,
    SLO_BUDGET,
    poisson_mode,
    render,
    targets,
    vllm_system,
    write_plots,
)
from benchmarks.suite import DEFAULT_SLO, Row, flatten

# Run-time estimate: output tok/s of the closed loop per concurrency (this 2-core machine, SmolLM2-135M,
# README's latest same-run figures), server start-up, and the Poisson drain after the last arrival.
ASSUMED_TOK_S = {8: 60.0, 16: 70.0, 32: 80.0}
STARTUP_S = {FIXED: 30.0, SLO_BUDGET: 30.0}
VLLM_STARTUP_S = 150.0
DRAIN_S = 25.0


@dataclass(frozen=True)
class Config:
    engine: Path
    levels: tuple[int, ...] = (8, 16, 32)
    requests_per_slot: int = 2
    input_len: int = 500
    output_len: int = 128
    rates: tuple[float, ...] | None = None  # Poisson rates (req/s); None: fractions of the measured saturation
    rate_fractions: tuple[float, ...] = (0.7, 0.9)
    arrival_s: float = 60.0  # seconds of arrivals per rate
    saturation_concurrency: int = 16
    saturation_requests: int = 24
    vllm: bool = True
    vllm_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    settings: servers.ServingSettings = field(default_factory=servers.ServingSettings)
    logs: Path = RESULTS_DIR / "logs" / "slo"

    def requests(self, c: int) -> int:
        return self.requests_per_slot * c


def poisson_rates(saturation_req_s: float, fractions: Sequence[float]) -> tuple[float, ...]:
    """Arrival rates at the given fractions of a measured saturation throughput (req/s, 3 decimals)."""
    if saturation_req_s <= 0:
        raise ValueError("the saturation throughput must be positive")
    return tuple(round(saturation_req_s * f, 3) for f in fractions)


def poisson_requests(rate: float, arrival_s: float) -> int:
    """Requests for `arrival_s` seconds of arrivals at `rate` (at least 4)."""
    return max(4, round(rate * arrival_s))


def itl_curve(records: Sequence[RequestRecord], quantiles: Sequence[float] = CURVE_Q) -> list[float]:
    """ITL (ms) at each percentile over every token gap of the successful requests ([] if none)."""
    gaps = [g for r in records if r.ok for g in r.itls()]
    return [round(float(x), 2) for x in np.percentile(np.asarray(gaps) * 1000, quantiles)] if gaps else []


def estimate_s(cfg: Config, systems: int, chat_rates: Sequence[float] | None = None) -> float:
    """Rough wall time of a run: closed-loop levels at ASSUMED_TOK_S, arrivals plus drain per rate,
    the saturation probe (when rates are measured), start-ups."""
    fixed = sum(cfg.requests(c) * cfg.output_len / ASSUMED_TOK_S.get(c, 60.0) for c in cfg.levels)
    rates = len(chat_rates if chat_rates is not None else cfg.rates or cfg.rate_fractions)
    poisson = rates * (cfg.arrival_s + DRAIN_S)
    probe = 0.0 if cfg.rates else cfg.saturation_requests * 80 / ASSUMED_TOK_S[16]  # ~80 tokens per chat answer
    startups = sum(STARTUP_S.values()) + (systems - len(STARTUP_S)) * VLLM_STARTUP_S
    return round(systems * (fixed + poisson + 20) + probe + startups)


@dataclass
class Workloads:
    """Prompts for every level and rate, built once: every system gets the same ones."""

    fixed: dict[int, list[BenchRequest]]
    warm: list[BenchRequest]
    chat: dict[float, list[BenchRequest]] = field(default_factory=dict)
    probe: list[BenchRequest] = field(default_factory=list)


class Run:
    def __init__(self, cfg: Config, tok, log: Callable[[str], None]):
        self.cfg, self.tok, self.log = cfg, tok, log
        self.rows: list[Row] = []
        self.curves: dict[str, dict[str, list[float]]] = {}
        self.extra: dict = {"datasets": {}, "quiet_waits_s": []}
        fixed = {c: datasets.fixed(tok, cfg.requests(c), cfg.input_len, cfg.output_len, seed=c) for c in cfg.levels}
        self.work = Workloads(fixed, datasets.fixed(tok, 2, cfg.input_len, 16, seed=99))
        for c, reqs in fixed.items():
            self.extra["datasets"][f"fixed c{c}"] = datasets.describe(reqs)
        self.rates: tuple[float, ...] = cfg.rates or ()
        if cfg.rates:
            self._chat(cfg.rates)

    def _chat(self, rates: Sequence[float]) -> None:
        for i, rate in enumerate(rates):
            self.work.chat[rate] = datasets.chat(self.tok, poisson_requests(rate, self.cfg.arrival_s),
                                                 self.cfg.output_len, seed=1000 + i)  # fmt: skip
            self.extra["datasets"][poisson_mode(rate)] = datasets.describe(self.work.chat[rate])

    def measure(self, row: Row, endpoint: client.Endpoint, reqs: list[BenchRequest], **load) -> dict:
        self.extra["quiet_waits_s"].append(wait_quiet(self.log))
        result = client.run(endpoint, reqs, self.work.warm, **load)
        summary = flatten(summarize(result.records, result.duration_s, DEFAULT_SLO))
        summary["client_cpu_s"] = round(result.client_cpu_s, 2)
        row.reps.append(summary)
        self.curves.setdefault(row.system, {})[row.mode] = itl_curve(result.records)
        self.log(f"  {row.system} | {row.mode}: {summary['output_tok_s']} tok/s, goodput {summary['goodput_req_s']} "
                 f"req/s, ITL p99 {summary.get('itl_ms_p99')} ms, TTFT p99 {summary.get('ttft_ms_p99')} ms, "
                 f"failed {summary['failed']} {summary['errors']}")  # fmt: skip
        return summary

    def serve(self, system: str, endpoint: client.Endpoint) -> None:
        cfg = self.cfg
        if not self.rates:  # the first server sets the Poisson rates for all
            c, n = cfg.saturation_concurrency, cfg.saturation_requests
            self.work.probe = datasets.chat(self.tok, n, cfg.output_len, seed=500)
            row = Row(
                "chat prompts, closed loop (saturation probe for the Poisson rates)", system, f"concurrency {c}", c
            )
            self.rows.append(row)
            saturation = self.measure(row, endpoint, self.work.probe, concurrency=c)["request_s"]
            self.rates = poisson_rates(saturation, cfg.rate_fractions)
            self.extra["saturation"] = {"system": system, "concurrency": c, "request_s": saturation,
                                        "fractions": list(cfg.rate_fractions), "rates": list(self.rates)}  # fmt: skip
            self.log(f"  saturation {saturation} req/s -> Poisson rates {self.rates}")
            self._chat(self.rates)
        for c in cfg.levels:
            row = Row(fixed_name(cfg), system, f"concurrency {c}", c)
            self.rows.append(row)
            self.measure(row, endpoint, self.work.fixed[c], concurrency=c)
        for i, rate in enumerate(self.rates):
            row = Row(chat_name(cfg), system, poisson_mode(rate), 0)
            self.rows.append(row)
            self.measure(row, endpoint, self.work.chat[rate], rate=rate, seed=i)

    def unavailable(self, system: str, reason: str) -> None:
        self.rows.append(Row(fixed_name(self.cfg), system, "-", 0, unavailable=reason[-600:]))
        self.log(f"  {system}: unavailable: {reason[-300:]}")


def fixed_name(cfg: Config) -> str:
    return f"fixed {cfg.input_len} -> {cfg.output_len} tokens (EOS ignored), closed loop"


def chat_name(cfg: Config) -> str:
    return f"chat prompts (EOS honoured, <= {cfg.output_len} tokens), Poisson arrivals, {cfg.arrival_s:g} s of them"


def run_all(cfg: Config, run: Run) -> None:
    for system, budget in ((FIXED, "0"), (SLO_BUDGET, None)):
        settings = servers.ServingSettings(**{**asdict(cfg.settings), "itl_target_ms": budget})
        run.log(f"== {system}")
        log = cfg.logs / f"tritonserver-{'fixed' if budget else 'slo'}.log"
        try:
            with servers.trtserve(cfg.engine, settings, log) as endpoint:
                run.serve(system, endpoint)
        except RuntimeError as exc:
            run.unavailable(system, f"{type(exc).__name__}: {exc}")
    if not cfg.vllm:
        return run.unavailable(vllm_system("float32"), "left out (--no-vllm)")
    from builder.sources import resolve_model

    checkpoint = resolve_model("smollm2-135m").checkpoint_dir
    for dtype in cfg.vllm_dtypes:
        system = vllm_system(dtype)
        run.log(f"== {system}: starting (takes minutes)")
        settings = servers.ServingSettings(**{**asdict(cfg.settings), "vllm_dtype": dtype})
        try:
            with servers.vllm(checkpoint, settings, cfg.logs / f"vllm-{dtype}.log") as endpoint:
                run.extra.setdefault("vllm", {"version": servers.vllm_version(), "dtypes": []})["dtypes"].append(dtype)
                run.serve(system, endpoint)
        except RuntimeError as exc:
            run.unavailable(system, str(exc))


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32")
@click.option("--vllm/--no-vllm", default=True, show_default=True, help="vLLM too (where its peer venv exists).")
@click.option("--vllm-dtypes", default="float32,bfloat16", show_default=True,
              help="vLLM runs, one per precision (fp32 is the like-for-like reference of the targets).")  # fmt: skip
@click.option("--quick", is_flag=True, help="One wave per level (c requests), 20 s of arrivals per rate.")
@click.option("--concurrency", default="8,16,32", show_default=True)
@click.option("--rates", default=None, help="Poisson rates, req/s (default: 0.7 and 0.9 x the measured saturation).")
@click.option("--arrival-s", default=60.0, show_default=True, help="Seconds of Poisson arrivals per rate.")
@click.option("--input-len", default=500, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option("--name", default="slo", show_default=True)
def main(engine: Path, vllm: bool, vllm_dtypes: str, quick: bool, concurrency: str, rates: str | None,
         arrival_s: float, input_len: int, output_len: int, name: str) -> None:  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer

    cfg = Config(engine, tuple(int(x) for x in concurrency.split(",") if x), 1 if quick else 2, input_len, output_len,
                 tuple(float(x) for x in rates.split(",")) if rates else None, arrival_s=20.0 if quick else arrival_s,
                 saturation_requests=12 if quick else 24, vllm=vllm,
                 vllm_dtypes=tuple(d for d in vllm_dtypes.split(",") if d),
                 logs=RESULTS_DIR / "logs" / name)  # fmt: skip
    cfg.logs.mkdir(parents=True, exist_ok=True)
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    has_vllm = vllm and (servers.VENVS / "vllm" / ".done").exists()
    estimate = estimate_s(cfg, 2 + (len(cfg.vllm_dtypes) if has_vllm else 0))
    log(f"estimated run time: ~{estimate / 60:.0f} min ({'with' if has_vllm else 'without'} vLLM)")
    busy, started = cpu_busy_fraction(), time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    run = Run(cfg, load_tokenizer(engine), log)
    run_all(cfg, run)
    payload = {"command": "python -m benchmarks.slo " + shlex.join(sys.argv[1:]), "cpu_busy_before": busy,
               "config": {**asdict(cfg), "engine": str(engine), "logs": str(cfg.logs)}, "estimate_s": estimate,
               "wall_s": round(time.time() - started, 1), "rates": list(run.rates),
               "rows": [r.to_json() for r in run.rows], "itl_curves": run.curves, "curve_percentiles": CURVE_Q,
               **run.extra}  # fmt: skip
    payload["controls"], payload["targets"] = controls(cfg, payload), targets(payload["rows"])
    md, full = write_report(name, payload, render)
    write_plots(full, name)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()


def controls(cfg: Config, payload: dict) -> list[str]:
    s = cfg.settings
    sat = payload.get("saturation")
    rates = (f"given (--rates {','.join(f'{r:g}' for r in cfg.rates)})" if cfg.rates else
             f"{' and '.join(f'{f:g}' for f in cfg.rate_fractions)} x the chat throughput of {sat['system']} "
             f"in a closed loop at concurrency {sat['concurrency']} ({sat['request_s']} req/s, measured first)"
             if sat else "-")  # fmt: skip
    return [
        f"every server: max {s.max_num_seqs} sequences, KV for {s.kv_tokens} tokens, {s.max_num_batched_tokens}-token "
        f"step budget, prefix caching {'on' if s.prefix_caching else 'off'}; trtserve through tritonserver "
        "(generate_stream SSE), vLLM through its OpenAI /v1/completions (token ids), both from benchmarks/client.py",
        f"fixed workload: {cfg.input_len} -> exactly {cfg.output_len} tokens, closed loop, "
        + ", ".join(f"c{c}: {cfg.requests(c)} requests" for c in cfg.levels),
        f"chat workload: Poisson arrivals (seeded), {cfg.arrival_s:g} s of arrivals per rate, no cap on requests "
        f"in flight (the servers queue); rates: {rates}",
        f"the same prompts and arrival times for every server; 2 warm-up requests ({cfg.input_len} -> 16) before every "
        "measured phase; one repetition (percentiles over every request / token gap of the phase)",
        f"goodput: requests/s meeting TTFT <= {DEFAULT_SLO.ttft_s:g} s and TPOT <= {DEFAULT_SLO.tpot_s * 1000:.0f} ms; "
        "ITL per token (a k-token chunk counts as k gaps)",
    ]

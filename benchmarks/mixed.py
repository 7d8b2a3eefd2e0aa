"""`python -m benchmarks.mixed`: issue 17's mixed chat traffic -> results/mixed.{json,md} + PNG.

Traffic shaped like a chat service (benchmarks/datasets.mixed: three ~300-token system prompts shared by
every request, lognormal user turns of ~80 tokens, answers of 16-256 tokens with EOS ignored), Poisson
arrivals at several rates from below to past saturation. trtserve (through tritonserver) and vLLM's
OpenAI server get the same limits (32 sequences, 512-token steps, prefix caching on) and the same
prompts and arrival times; repetitions interleave rates (rep 1 of every rate, then rep 2, ...), each
repetition with fresh user turns. Goodput is the headline: requests/s meeting TTFT <= 3 s and
TPOT <= 250 ms.

    python -m benchmarks.mixed --engine /work/engines/v3/smollm2-135m-b32 [--backend cpu-bf16]
        [--more-engines DIR[@BACKEND],...]
"""

from __future__ import annotations

import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import click

from benchmarks import client, datasets, plots, prometheus, servers, tables
from benchmarks.cpu import wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import SLO, summarize
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_report
from benchmarks.slo_report import poisson_mode, vllm_system
from benchmarks.suite import Row, flatten
from engine_format import EngineConfig

MIXED_SLO = SLO(ttft_s=3.0, tpot_s=0.25)
WORKLOAD = (
    "benchmarks.datasets.mixed: 3 shared ~300-token system prompts, lognormal user turns (mean ~80 "
    "tokens), answers uniform in 16-256 tokens with EOS ignored; Poisson arrivals; every server: 32 "
    "sequences, 512-token steps, KV for 65,536 tokens, prefix caching on; 2 warm-up requests per phase"
)
TOK_S_VS_VLLM, GOODPUT_VS_VLLM = 1.3, 1.5  # issue 17's targets near and past saturation
# Drafts per step of a "+ngram" run, trtserve's and vLLM's alike. In process at saturation (LLMEngine, 40
# in flight, cpu-bf16, int8 KV, before the AMX tiles): k = 2 / 3 / 4 gave 728 / 761 / 711 tok/s.
NGRAM_TOKENS = 3
NGRAM = "+ngram"
THREAD = "+thread"  # a trtserve run whose engine core runs on a thread of the Triton stub (--no-engine-process)


def _split_suffixes(text: str, allowed: tuple[str, ...] = (NGRAM,)) -> tuple[str, set[str]]:
    """A run's text, "X" then any of `allowed` ("+ngram", "+thread"), as (X, the suffixes given)."""
    suffixes: set[str] = set()
    while "+" in text:
        text, _, tail = text.rpartition("+")
        if f"+{tail}" not in allowed:
            raise click.BadParameter(f"{text}+{tail!r}: a run takes only {', '.join(allowed)}")
        suffixes.add(f"+{tail}")
    return text, suffixes


def _ngram_label(ngram: bool) -> str:
    return f", n-gram speculation k={NGRAM_TOKENS}" if ngram else ""


@dataclass(frozen=True)
class TrtserveRun:
    """One trtserve server of the run: an engine directory on a backend (None: the engine's default),
    with n-gram speculation or without."""

    engine: Path
    backend: str | None = None
    ngram: bool = False
    core_thread: bool = False  # the engine core on a thread of the stub, not in a process of its own

    @classmethod
    def parse(cls, text: str) -> TrtserveRun:
        """DIR, DIR@BACKEND, either + "+ngram" and/or "+thread"."""
        text, suffixes = _split_suffixes(text, (NGRAM, THREAD))
        engine, _, backend = text.partition("@")
        return cls(Path(engine), backend or None, NGRAM in suffixes, THREAD in suffixes)

    @property
    def log_name(self) -> str:
        backend = "-" + self.backend if self.backend else ""
        return f"{self.engine.name}{backend}{'-ngram' * self.ngram}{'-thread' * self.core_thread}"

    @property
    def params(self) -> dict[str, str]:
        """Its config.pbtxt parameters beyond the run's settings. Speculation stays on whatever the queue
        (the default turns it off past 4 requests); the engine's governor still judges it by measured cost."""
        params = {"backend": self.backend} if self.backend else {}
        if self.core_thread:
            params["engine_process"] = "false"
        if self.ngram:
            params |= {"speculative": "ngram", "num_speculative_tokens": str(NGRAM_TOKENS),
                       "speculative_disable_batch_size": "4096"}  # fmt: skip
        return params

    @property
    def system(self) -> str:
        """The row label: what the engine is and what runs it."""
        config = EngineConfig.load(self.engine)
        weights = f"{config.quantization} weights" if config.quantization else f"{config.dtype} weights"
        backend = f", backend {self.backend}" if self.backend else ""
        core = ", engine core on the stub's thread" if self.core_thread else ""
        name = f"{config.kv_cache_dtype} KV{backend}{_ngram_label(self.ngram)}{core}"
        return f"trtserve via Triton ({weights}, {name}: {self.engine.name})"


@dataclass(frozen=True)
class VllmRun:
    """One vLLM server of the run: its dtype, with n-gram speculation or without."""

    dtype: str
    ngram: bool = False

    @classmethod
    def parse(cls, text: str) -> VllmRun:
        """DTYPE or DTYPE+ngram."""
        dtype, suffixes = _split_suffixes(text)
        return cls(dtype, NGRAM in suffixes)

    @property
    def system(self) -> str:
        return vllm_system(self.dtype) + _ngram_label(self.ngram)

    @property
    def log_name(self) -> str:
        return f"{self.dtype}{'-ngram' * self.ngram}"


@dataclass(frozen=True)
class Config:
    engine: Path
    backend: str | None = None  # the main engine's (executors.BACKENDS; None: its default)
    rates: tuple[float, ...] = (1.0, 1.75, 2.5, 3.25)
    arrival_s: float = 60.0  # seconds of arrivals per (rate, repetition)
    repetitions: int = 3
    vllm_runs: tuple[VllmRun, ...] = (VllmRun("float32"),)
    more_engines: tuple[TrtserveRun, ...] = ()  # further trtserve runs (e.g. an int8-KV build), after the main one
    ngram: bool = False  # the main engine speculates (n-gram, NGRAM_TOKENS drafts)
    settings: servers.ServingSettings = field(default_factory=servers.ServingSettings)
    logs: Path = RESULTS_DIR / "logs" / "mixed"

    @property
    def trtserve_runs(self) -> tuple[TrtserveRun, ...]:
        """The main run (the targets' trtserve side) first."""
        return TrtserveRun(self.engine, self.backend, self.ngram), *self.more_engines


def build_workloads(tok, cfg: Config) -> dict[tuple[float, int], list[BenchRequest]]:
    """Prompts per (rate, repetition), built once so every server gets the same ones."""
    return {(rate, rep): datasets.mixed(tok, max(4, round(rate * cfg.arrival_s)), seed=1 + rep * 100 + i)
            for rep in range(cfg.repetitions) for i, rate in enumerate(cfg.rates)}  # fmt: skip


def offered_tok_s(work: dict[tuple[float, int], list[BenchRequest]], arrival_s: float) -> dict[float, float]:
    """Output tok/s each rate asks for (its answers' tokens over the arrival window; median of the
    repetitions). No server's output tok/s can exceed it, so it bounds the tok/s ratio to vLLM at that rate."""
    by_rate: dict[float, list[float]] = {}
    for (rate, _), requests in work.items():
        by_rate.setdefault(rate, []).append(sum(r.max_tokens for r in requests) / arrival_s)
    return {rate: round(statistics.median(v), 1) for rate, v in by_rate.items()}


def measure_server(cfg: Config, system: str, endpoint: client.Endpoint, work: dict, warm: list[BenchRequest],
                   log: Callable[[str], None]) -> list[Row]:  # fmt: skip
    rows = {rate: Row("mixed chat traffic, Poisson arrivals", system, poisson_mode(rate), 0) for rate in cfg.rates}
    for rep in range(cfg.repetitions):
        for i, rate in enumerate(cfg.rates):
            wait_quiet(log)
            before = prometheus.fetch(endpoint.metrics_url) if endpoint.metrics_url else None
            result = client.run(endpoint, work[rate, rep], warm, rate=rate, seed=rep * 100 + i)
            summary = flatten(summarize(result.records, result.duration_s, MIXED_SLO))
            summary["client_cpu_s"] = round(result.client_cpu_s, 2)
            if before is not None and endpoint.metrics_url:
                summary.update(engine_steps(before, prometheus.fetch(endpoint.metrics_url), result.duration_s))
            rows[rate].reps.append(summary)
            log(f"  {system} | {poisson_mode(rate)} rep {rep + 1}: {summary['output_tok_s']} tok/s, goodput "
                f"{summary['goodput_req_s']} req/s, TPOT p50 {summary.get('tpot_ms_p50')} ms, "
                f"failed {summary['failed']} {summary['errors']}")  # fmt: skip
    return list(rows.values())


def engine_steps(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict:
    """trtserve's own account of a phase (its /metrics): the share of the wall time the engine spent in
    steps (the rest is idle or waiting on the transport), the mean step, and prefix-cache hits. The
    warm-up requests count too (two 8-token answers)."""
    name = "trtserve_step_duration_seconds"
    busy = prometheus.total(after, f"{name}_sum") - prometheus.total(before, f"{name}_sum")
    steps = prometheus.total(after, f"{name}_count") - prometheus.total(before, f"{name}_count")
    return {"engine_busy": round(busy / duration_s, 3) if duration_s > 0 else None,
            "engine_step_ms_mean": round(1000 * busy / steps, 1) if steps else None,
            "prefix_cache_hit_rate": prometheus.hit_rate(before, after)["hit_rate"]}  # fmt: skip


def run_all(cfg: Config, tok, work: dict[tuple[float, int], list[BenchRequest]], log: Callable[[str], None]
            ) -> list[Row]:  # fmt: skip
    warm = [datasets.mixed(tok, 2, seed=99, answer_range=(8, 8))[i] for i in range(2)]
    rows: list[Row] = []
    for run in cfg.trtserve_runs:
        system = run.system
        log(f"== {system}: starting")
        settings = replace(cfg.settings, extra_params={**cfg.settings.extra_params, **run.params})
        logs = cfg.logs / f"tritonserver-{run.log_name}.log"
        try:
            with servers.trtserve(run.engine, settings, logs) as endpoint:
                rows += measure_server(cfg, system, endpoint, work, warm, log)
        except RuntimeError as exc:
            rows.append(Row("mixed chat traffic, Poisson arrivals", system, "-", 0, unavailable=str(exc)[-600:]))
    from builder.sources import resolve_model

    checkpoint = resolve_model("smollm2-135m").checkpoint_dir
    for vllm_run in cfg.vllm_runs:
        system = vllm_run.system
        log(f"== {system}: starting (takes minutes)")
        settings = replace(cfg.settings, vllm_dtype=vllm_run.dtype, vllm_ngram_tokens=NGRAM_TOKENS * vllm_run.ngram)
        try:
            with servers.vllm(checkpoint, settings, cfg.logs / f"vllm-{vllm_run.log_name}.log") as endpoint:
                rows += measure_server(cfg, system, endpoint, work, warm, log)
        except RuntimeError as exc:
            rows.append(Row("mixed chat traffic, Poisson arrivals", system, "-", 0, unavailable=str(exc)[-600:]))
    return rows


def targets(rows: list[dict], offered: dict[float, float], trtserve: str, vllm: str) -> list[dict]:
    """Issue 17's targets at each rate of `offered` (rate -> offered output tok/s): tok/s and goodput ratios
    of `trtserve` to `vllm` (row labels), TPOT p50 no worse; with the highest tok/s ratio the offered load
    allows."""
    out = []
    for rate, offered_tok_s in offered.items():
        ours, peer = (next((r["median"] for r in rows if r["system"] == s and r["mode"] == poisson_mode(rate)
                            and r.get("median")), None) for s in (trtserve, vllm))  # fmt: skip
        if not ours or not peer:
            out.append({"rate": rate, "status": "not measured"})
            continue
        tok = ours["output_tok_s"] / peer["output_tok_s"]
        good = ours["goodput_req_s"] / peer["goodput_req_s"] if peer["goodput_req_s"] else float("inf")
        out.append({"rate": rate, "tok_s_ratio": round(tok, 3), "goodput_ratio": round(good, 3),
                    "tpot_p50_ms": [ours["tpot_ms_p50"], peer["tpot_ms_p50"]], "offered_tok_s": offered_tok_s,
                    "tok_s_ratio_bound": round(offered_tok_s / peer["output_tok_s"], 3),
                    "met": tok >= TOK_S_VS_VLLM and good >= GOODPUT_VS_VLLM
                    and ours["tpot_ms_p50"] <= peer["tpot_ms_p50"]})  # fmt: skip
    return out


def render(p: dict) -> str:
    m, slo = p["machine"], {"ttft_s": MIXED_SLO.ttft_s, "tpot_s": MIXED_SLO.tpot_s}
    lines = [
        "# Mixed chat traffic at saturation (issue 17)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; run {p['date_utc']}, {p['wall_s']:.0f} s wall. "
        f"Command: `{p['command']}`",
        tables._quiet_line(p),
        "",
        f"Workload: {p['workload']}",
        "",
    ]
    for reference in p["targets"]:
        lines += [
            f"## Targets: {p['trtserve_reference']} vs {reference['vllm']}",
            "",
            f"tok/s ≥ {TOK_S_VS_VLLM}x, goodput ≥ {GOODPUT_VS_VLLM}x, TPOT p50 no worse (medians).",
            "",
            "Offered: the answers' tokens over the arrival window. No server outputs more, so the tok/s ratio "
            "cannot exceed offered / vLLM's tok/s (the bound); the drain after the last arrival keeps even a server "
            "that keeps up below it.",
            "",
            "| rate | offered tok/s | tok/s ratio (bound) | goodput ratio | TPOT p50 ms (trtserve / vLLM) | all met |",
            "|---|---|---|---|---|---|",
        ]
        for t in reference["by_rate"]:
            if "tok_s_ratio" in t:
                tp = t["tpot_p50_ms"]
                lines.append(f"| {t['rate']:g} | {t['offered_tok_s']:.0f} | {t['tok_s_ratio']:.2f}x "
                             f"({t['tok_s_ratio_bound']:.2f}x) | {t['goodput_ratio']:.2f}x | {tp[0]:.0f} / "
                             f"{tp[1]:.0f} | {'yes' if t['met'] else 'no'} |")  # fmt: skip
            else:
                lines.append(f"| {t['rate']:g} | - | - | - | - | not measured |")
        lines.append("")
    lines += ["## Results (median of repetitions, min–max in brackets)", "", *tables.workload_table(p["rows"], slo)]
    lines += ["", "## trtserve's engine during each phase (its /metrics; medians)", "",
              "Busy: share of the phase's wall time spent in engine steps; the rest the engine waited (for work, or "
              "for the transport).", "",
              "| system | rate | engine busy | mean step ms | prefix-cache hit rate |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in p["rows"]:
        reps = [x for x in r["reps"] if x.get("engine_busy") is not None]
        if reps:
            busy, step, hits = (statistics.median(x[k] or 0 for x in reps)
                                for k in ("engine_busy", "engine_step_ms_mean", "prefix_cache_hit_rate"))  # fmt: skip
            lines.append(f"| {r['system']} | {r['mode']} | {busy:.0%} | {step:.1f} | {hits:.2f} |")
    return "\n".join(lines) + "\n"


def write_plot(p: dict, name: str) -> None:
    series: dict[str, dict[str, list[tuple[float, float]]]] = {"goodput": {}}
    for r in p["rows"]:
        if r.get("median"):
            rate = float(r["mode"].split()[1])
            series["goodput"].setdefault(r["system"], []).append((rate, r["median"]["goodput_req_s"]))
    label = f"goodput, req/s (TTFT ≤ {MIXED_SLO.ttft_s:g} s, TPOT ≤ {MIXED_SLO.tpot_s * 1000:.0f} ms)"
    plots.goodput_vs_load(series, ("arrival rate, req/s",), RESULTS_DIR / f"{name}_goodput.png", ylabel=label)


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32")
@click.option("--rates", default="1,1.75,2.5,3.25", show_default=True, help="Poisson arrival rates, req/s.")
@click.option("--arrival-s", default=60.0, show_default=True, help="Seconds of arrivals per rate and repetition.")
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option(
    "--vllm-dtypes",
    default="float32",
    show_default=True,
    help=f"vLLM runs: comma-separated DTYPE or DTYPE{NGRAM} ('' for none); each gets a target table.",
)
@click.option("--backend", default=None, help="The main engine's backend (default: the engine's default).")
@click.option("--ngram", is_flag=True, help=f"The main engine speculates: n-gram, {NGRAM_TOKENS} drafts a step.")
@click.option(
    "--more-engines",
    default="",
    help=f"Further trtserve runs: comma-separated DIR or DIR@BACKEND, either + {NGRAM!r} and/or {THREAD!r} (the "
    "engine core on the stub's thread); an engine may run twice.",
)
@click.option(
    "--stream-interval",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Tokens per streamed response, on every server (vLLM's --stream-interval).",
)
@click.option("--name", default="mixed", show_default=True)
def main(engine: Path, rates: str, arrival_s: float, repetitions: int, vllm_dtypes: str, backend: str | None,
         ngram: bool, more_engines: str, stream_interval: int, name: str) -> None:  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer

    vllm_runs = tuple(VllmRun.parse(d) for d in vllm_dtypes.split(",") if d)
    cfg = Config(engine, backend, tuple(float(x) for x in rates.split(",")), arrival_s, repetitions, vllm_runs,
                 tuple(TrtserveRun.parse(e) for e in more_engines.split(",") if e), ngram=ngram,
                 settings=servers.ServingSettings(stream_interval=stream_interval),
                 logs=RESULTS_DIR / "logs" / name)  # fmt: skip
    cfg.logs.mkdir(parents=True, exist_ok=True)
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    busy, started = cpu_busy_fraction(), time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    tok = load_tokenizer(engine)
    work = build_workloads(tok, cfg)
    rows = [r.to_json() for r in run_all(cfg, tok, work, log)]
    offered = offered_tok_s(work, cfg.arrival_s)
    ours = cfg.trtserve_runs[0].system
    payload = {"command": "python -m benchmarks.mixed " + shlex.join(sys.argv[1:]), "cpu_busy_before": busy,
               "config": {**asdict(cfg), "engine": str(engine), "logs": str(cfg.logs),
                          "more_engines": [f"{r.engine}@{r.backend or ''}" for r in cfg.more_engines]},
               "workload": WORKLOAD, "wall_s": round(time.time() - started, 1), "rows": rows,
               "trtserve_reference": ours,
               "targets": [{"vllm": v.system, "by_rate": targets(rows, offered, ours, v.system)}
                           for v in cfg.vllm_runs]}  # fmt: skip
    md, full = write_report(name, payload, render)
    write_plot(full, name)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

"""`python -m benchmarks.mixed`: issue 17's mixed chat traffic -> results/mixed.{json,md} + PNG.

Traffic shaped like a chat service (benchmarks/datasets.mixed: three ~300-token system prompts shared by
every request, lognormal user turns of ~80 tokens, answers of 16-256 tokens with EOS ignored), Poisson
arrivals at several rates from below to past saturation. trtserve (through tritonserver) and vLLM's
OpenAI server get the same limits (32 sequences, 512-token steps, prefix caching on) and the same
prompts and arrival times; repetitions interleave rates (rep 1 of every rate, then rep 2, ...), each
repetition with fresh user turns. Goodput is the headline: requests/s meeting TTFT <= 3 s and
TPOT <= 250 ms.

    python -m benchmarks.mixed --engine /work/engines/v3/smollm2-135m-b32
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from benchmarks import client, datasets, plots, servers, tables
from benchmarks.cpu import wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import SLO, summarize
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_report
from benchmarks.slo_report import poisson_mode, vllm_system
from benchmarks.suite import Row, flatten

MIXED_SLO = SLO(ttft_s=3.0, tpot_s=0.25)
TRTSERVE = "trtserve via Triton (fp32 engine)"
WORKLOAD = (
    "benchmarks.datasets.mixed: 3 shared ~300-token system prompts, lognormal user turns (mean ~80 "
    "tokens), answers uniform in 16-256 tokens with EOS ignored; Poisson arrivals; every server: 32 "
    "sequences, 512-token steps, KV for 65,536 tokens, prefix caching on; 2 warm-up requests per phase"
)
TOK_S_VS_VLLM, GOODPUT_VS_VLLM = 1.3, 1.5  # issue 17's targets near and past saturation


@dataclass(frozen=True)
class Config:
    engine: Path
    rates: tuple[float, ...] = (1.0, 1.75, 2.5, 3.25)
    arrival_s: float = 60.0  # seconds of arrivals per (rate, repetition)
    repetitions: int = 3
    vllm_dtypes: tuple[str, ...] = ("float32",)
    settings: servers.ServingSettings = field(default_factory=servers.ServingSettings)
    logs: Path = RESULTS_DIR / "logs" / "mixed"


def build_workloads(tok, cfg: Config) -> dict[tuple[float, int], list[BenchRequest]]:
    """Prompts per (rate, repetition), built once so every server gets the same ones."""
    return {(rate, rep): datasets.mixed(tok, max(4, round(rate * cfg.arrival_s)), seed=1 + rep * 100 + i)
            for rep in range(cfg.repetitions) for i, rate in enumerate(cfg.rates)}  # fmt: skip


def measure_server(cfg: Config, system: str, endpoint: client.Endpoint, work: dict, warm: list[BenchRequest],
                   log: Callable[[str], None]) -> list[Row]:  # fmt: skip
    rows = {rate: Row("mixed chat traffic, Poisson arrivals", system, poisson_mode(rate), 0) for rate in cfg.rates}
    for rep in range(cfg.repetitions):
        for i, rate in enumerate(cfg.rates):
            wait_quiet(log)
            result = client.run(endpoint, work[rate, rep], warm, rate=rate, seed=rep * 100 + i)
            summary = flatten(summarize(result.records, result.duration_s, MIXED_SLO))
            summary["client_cpu_s"] = round(result.client_cpu_s, 2)
            rows[rate].reps.append(summary)
            log(f"  {system} | {poisson_mode(rate)} rep {rep + 1}: {summary['output_tok_s']} tok/s, goodput "
                f"{summary['goodput_req_s']} req/s, TPOT p50 {summary.get('tpot_ms_p50')} ms, "
                f"failed {summary['failed']} {summary['errors']}")  # fmt: skip
    return list(rows.values())


def run_all(cfg: Config, tok, log: Callable[[str], None]) -> list[Row]:
    work = build_workloads(tok, cfg)
    warm = [datasets.mixed(tok, 2, seed=99, answer_range=(8, 8))[i] for i in range(2)]
    rows: list[Row] = []
    try:
        with servers.trtserve(cfg.engine, cfg.settings, cfg.logs / "tritonserver.log") as endpoint:
            rows += measure_server(cfg, TRTSERVE, endpoint, work, warm, log)
    except RuntimeError as exc:
        rows.append(Row("mixed chat traffic, Poisson arrivals", TRTSERVE, "-", 0, unavailable=str(exc)[-600:]))
    from builder.sources import resolve_model

    checkpoint = resolve_model("smollm2-135m").checkpoint_dir
    for dtype in cfg.vllm_dtypes:
        system = vllm_system(dtype)
        log(f"== {system}: starting (takes minutes)")
        settings = servers.ServingSettings(**{**asdict(cfg.settings), "vllm_dtype": dtype})
        try:
            with servers.vllm(checkpoint, settings, cfg.logs / f"vllm-{dtype}.log") as endpoint:
                rows += measure_server(cfg, system, endpoint, work, warm, log)
        except RuntimeError as exc:
            rows.append(Row("mixed chat traffic, Poisson arrivals", system, "-", 0, unavailable=str(exc)[-600:]))
    return rows


def targets(rows: list[dict], rates: tuple[float, ...], vllm: str) -> list[dict]:
    """Issue 17's targets at each rate: tok/s and goodput ratios to vLLM, TPOT p50 no worse."""
    out = []
    for rate in rates:
        ours, peer = (next((r["median"] for r in rows if r["system"] == s and r["mode"] == poisson_mode(rate)
                            and r.get("median")), None) for s in (TRTSERVE, vllm))  # fmt: skip
        if not ours or not peer:
            out.append({"rate": rate, "status": "not measured"})
            continue
        tok = ours["output_tok_s"] / peer["output_tok_s"]
        good = ours["goodput_req_s"] / peer["goodput_req_s"] if peer["goodput_req_s"] else float("inf")
        out.append({"rate": rate, "tok_s_ratio": round(tok, 3), "goodput_ratio": round(good, 3),
                    "tpot_p50_ms": [ours["tpot_ms_p50"], peer["tpot_ms_p50"]],
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
        f"## Targets vs {p['vllm_reference']}",
        "",
        f"tok/s ≥ {TOK_S_VS_VLLM}x, goodput ≥ {GOODPUT_VS_VLLM}x, TPOT p50 no worse (medians).",
        "",
        "| rate | tok/s ratio | goodput ratio | TPOT p50 ms (trtserve / vLLM) | all met |",
        "|---|---|---|---|---|",
    ]
    for t in p["targets"]:
        if "tok_s_ratio" in t:
            tp = t["tpot_p50_ms"]
            lines.append(f"| {t['rate']:g} | {t['tok_s_ratio']:.2f}x | {t['goodput_ratio']:.2f}x | {tp[0]:.0f} / "
                         f"{tp[1]:.0f} | {'yes' if t['met'] else 'no'} |")  # fmt: skip
        else:
            lines.append(f"| {t['rate']:g} | - | - | - | not measured |")
    lines += ["", "## Results (median of repetitions, min–max in brackets)", "", *tables.workload_table(p["rows"], slo)]
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
@click.option("--vllm-dtypes", default="float32", show_default=True, help="vLLM runs ('' for none).")
@click.option("--name", default="mixed", show_default=True)
def main(engine: Path, rates: str, arrival_s: float, repetitions: int, vllm_dtypes: str, name: str) -> None:
    from runtime.engine.tokenizer import load_tokenizer

    dtypes = tuple(d for d in vllm_dtypes.split(",") if d)
    cfg = Config(engine, tuple(float(x) for x in rates.split(",")), arrival_s, repetitions, dtypes,
                 logs=RESULTS_DIR / "logs" / name)  # fmt: skip
    cfg.logs.mkdir(parents=True, exist_ok=True)
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    busy, started = cpu_busy_fraction(), time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    rows = [r.to_json() for r in run_all(cfg, load_tokenizer(engine), log)]
    reference = vllm_system(dtypes[0]) if dtypes else "-"
    payload = {"command": "python -m benchmarks.mixed " + shlex.join(sys.argv[1:]), "cpu_busy_before": busy,
               "config": {**asdict(cfg), "engine": str(engine), "logs": str(cfg.logs)},
               "workload": WORKLOAD, "wall_s": round(time.time() - started, 1), "rows": rows,
               "vllm_reference": reference, "targets": targets(rows, cfg.rates, reference)}  # fmt: skip
    md, full = write_report(name, payload, render)
    write_plot(full, name)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

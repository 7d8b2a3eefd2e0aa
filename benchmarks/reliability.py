"""`python -m benchmarks.reliability soak|chaos|burst`: does `trtserve serve` lose requests, crash or leak?

    python -m benchmarks.reliability soak --engine DIR [--backend cpu|cpu-bf16] [--rate R] [--duration-s S]
    python -m benchmarks.reliability chaos --engine DIR [--kills stub,tritonserver,gateway[,hang]] [--serve-args ARGS]
    python -m benchmarks.reliability burst --engine TINY --streams 2000
    python -m benchmarks.reliability burst --engine TINY --tenants heavy:4000:2000,light-a:500,light-b:500

Each mode starts `trtserve serve --engine DIR --max-num-seqs 32 --num-kv-blocks 1024` as a user would (a
subprocess on free ports; benchmarks.reliability_serve watches it) and sends traffic through its OpenAI door
(benchmarks.reliability_workload, _client). soak: mixed traffic for --duration-s. chaos: the same traffic; after
--warmup-s it SIGKILLs the model's stub, then (serving again) tritonserver, then the gateway, each once the
previous kill is recovered from and --settle-s passed. burst: --streams streaming requests at once (or each
--tenants tenant's, with its API key: benchmarks.reliability_tenants). Then the
load stops, requests in flight are waited for, serve gets SIGTERM. Results: results/reliability-<mode>[-<label>]
.{json,md} (benchmarks.reliability_report); each request's record, serve's output and the Triton and gateway
logs in results/logs/reliability-<mode>[-<label>]/.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from benchmarks import report
from benchmarks.cpu import machine_busy_s
from benchmarks.reliability_checks import cpu_use, crashes, healthy, kv_after, rss_timeline
from benchmarks.reliability_client import Load, Result
from benchmarks.reliability_plot import timeline
from benchmarks.reliability_report import first_served_after, kill_report, render, summary, targets
from benchmarks.reliability_serve import Serve, Watch, uptime_s
from benchmarks.reliability_tenants import TenantLoad, parse, tenant_summary, write_tenants_file
from benchmarks.reliability_workload import Job, Mix, Prompts, jobs
from engine_format import EngineConfig

KILLS = ("stub", "tritonserver", "gateway")
HANG = "hang"  # not a kill: the model's stub SIGSTOPped (a hung process, found by the heartbeat), --kills ...,hang
RECOVERY_WAIT_S = 180.0  # a kill not recovered from by then is reported as such, and the next one goes on


def log(message: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {message}", err=True)


@dataclass(frozen=True)
class Run:
    mode: str
    engine: Path
    backend: str | None = None
    rate: float = 1.0
    duration_s: float = 600.0
    seed: int = 0
    label: str | None = None
    drain_wait_s: float = 900.0
    mix: Mix = field(default_factory=Mix)
    kills: tuple[str, ...] = KILLS
    warmup_s: float = 60.0
    settle_s: float = 30.0
    streams: int = 2000
    serve_args: tuple[str, ...] = ()  # more `trtserve serve` options (e.g. --standby, --kv-disk-cache DIR)
    tenants: tuple[TenantLoad, ...] = ()  # burst: whose streams (in place of --streams)
    tenant_keys: bool = True  # False: the tenants' traffic without keys, to an open gateway

    @property
    def name(self) -> str:
        return f"reliability-{self.mode}" + (f"-{self.label}" if self.label else "")

    @property
    def total_streams(self) -> int:
        return sum(t.streams for t in self.tenants) if self.tenants else self.streams

    def describe(self, mix: Mix) -> str:
        if self.mode == "burst":
            who = ", ".join(f"{t.name} {t.streams}" for t in self.tenants)
            return (
                f"{self.total_streams} streaming requests sent at once"
                + (f" ({who})" if who else "")
                + f", answers of {mix.answer_tokens[0]}-{mix.answer_tokens[1]} tokens"
            )
        low, high = self.rate * 2 / 3, self.rate * 4 / 3
        length = f"{self.duration_s:g} s" if self.mode == "soak" else "until the kills are done + settle"
        return (f"Poisson arrivals, mean {self.rate:g} req/s ({low:.2f} and {high:.2f} req/s in alternating "
                f"{mix.burst_period_s:g}-s periods) for {length}")  # fmt: skip


def workload(mix: Mix, mode: str) -> str:
    if mode == "burst":
        return (f"streamed chat requests, RAG over {mix.documents} shared ~{mix.doc_tokens}-token documents "
                "(pydoc_data text) and one-shot questions via /v1/completions alternating, answers of "
                f"{mix.answer_tokens[0]}-{mix.answer_tokens[1]} tokens (EOS ignored), none cancelled")  # fmt: skip
    return (
        f"{mix.rag:.0%} RAG chat requests over {mix.documents} shared ~{mix.doc_tokens}-token documents "
        f"(pydoc_data text), {mix.chat:.0%} multi-turn chats ({mix.turns[0]}-{mix.turns[1]} turns, earlier answers "
        "fed back), "
        f"{1 - mix.rag - mix.chat:.0%} one-shot questions via /v1/completions; answers log-uniform "
        f"{mix.answer_tokens[0]}-{mix.answer_tokens[1]} tokens (EOS ignored, temperature 0.7); {mix.stream:.0%} "
        f"streamed, {mix.cancel:.0%} of streams cancelled by the client mid-stream; OpenAI JSON over aiohttp"
    )


def burst_jobs(count: int, mix: Mix, seed: int, tenants: Sequence[TenantLoad] = ()) -> list[Job]:
    """`count` streams at t=0 (or each tenant's, in their order), RAG and one-shot alternating, answers spread over
    the mix's range."""
    owners = [t.name for t in tenants for _ in range(t.streams)] if tenants else [None] * count
    low, high = mix.answer_tokens
    return [
        Job(i, 0.0, "rag" if i % 2 else "oneshot", True, low + (i * 7919 + seed) % (high - low + 1), None, i, owner)
        for i, owner in enumerate(owners)
    ]


async def chaos(serve: Serve, load: Load, run: Run) -> list[dict]:
    """Kill each of `run.kills` in turn once the previous one is recovered from: (target, pid, kill time, serve's
    restart line)."""
    await asyncio.sleep(max(0.0, run.warmup_s - load.now()))
    kills = []
    for target in run.kills:
        pid = serve.model_stub() if target in ("stub", HANG) else serve.child(target)
        if pid is None:
            kills.append({"target": target, "pid": None, "t_kill": load.now(), "restart": None})
            continue
        before = len(serve.restarts())
        t_kill = load.now()
        os.kill(pid, signal.SIGSTOP if target == HANG else signal.SIGKILL)
        log(f"{'stopped the stub' if target == HANG else f'killed {target}'} (pid {pid}) at {t_kill:.1f} s")
        while load.now() - t_kill < RECOVERY_WAIT_S and (
            len(serve.restarts()) <= before or first_served_after(load.results, t_kill) is None
        ):
            await asyncio.sleep(0.2)
        restarts = serve.restarts()
        restart = None
        if len(restarts) > before:
            t, child, seconds = restarts[before]
            restart = {"t_s": round(t - load.t0, 1), "child": child, "serving_again_s": seconds}
        log(f"  recovered: serve said {restart}; first completion after the kill at "
            f"{first_served_after(load.results, t_kill)}")  # fmt: skip
        kills.append({"target": target, "pid": pid, "t_kill": t_kill, "restart": restart})
        await asyncio.sleep(run.settle_s)
    return kills


async def drive(serve: Serve, load: Load, run: Run, mix: Mix) -> tuple[float, list[dict]]:
    """The mode's traffic (and kills): (when the last request was sent, the kills)."""
    if run.mode == "burst":
        planned = burst_jobs(run.streams, mix, run.seed, run.tenants)
        return await load.run(iter(planned), lambda job: False, run.drain_wait_s), []
    if run.mode == "soak":
        return await load.run(jobs(run.rate, mix, run.seed), lambda job: job.at >= run.duration_s, run.drain_wait_s), []
    done: list[float] = []
    controller = asyncio.create_task(chaos(serve, load, run))
    controller.add_done_callback(lambda _: done.append(load.now()))
    last = await load.run(jobs(run.rate, mix, run.seed), lambda job: bool(done) and job.at >= done[0],
                          run.drain_wait_s)  # fmt: skip
    return last, await controller


def kill_reports(kills: list[dict], results: list[Result], end: float) -> list[dict]:
    """Each kill's report, a request counted for the last kill before its end."""
    untils = [k["t_kill"] for k in kills[1:]] + [end] if kills else []  # soak and burst kill nothing
    return [kill_report(k["target"], k["pid"], k["t_kill"], results, k["restart"], until)
            for k, until in zip(kills, untils, strict=True)]  # fmt: skip


def measure(run: Run, command: str, log_fn: Callable[[str], None] = log) -> tuple[dict, list[Result]]:
    """Start serve, drive the mode's traffic, stop serve; returns the payload the report is written from, and every
    request's record."""
    from runtime.engine.tokenizer import load_tokenizer

    log_dir = report.RESULTS_DIR / "logs" / run.name
    shutil.rmtree(log_dir, ignore_errors=True)  # this run's logs only
    log_dir.mkdir(parents=True)
    max_seq_len = EngineConfig.load(run.engine).max_seq_len
    mix = run.mix.fit(max_seq_len)
    model = run.engine.resolve().name
    prompts = Prompts(load_tokenizer(run.engine), mix, max_seq_len, model, run.seed)
    started, since, busy0, client0 = time.monotonic(), uptime_s(), machine_busy_s(), time.process_time()
    quiet_before = report.cpu_busy_fraction()
    keyed = bool(run.tenants) and run.tenant_keys
    tenants_args = ("--tenants", str(write_tenants_file(run.tenants, log_dir / "tenants.yaml"))) if keyed else ()
    serve = Serve(run.engine, run.backend, log_dir / "serve.log", (*run.serve_args, *tenants_args))
    try:
        ready_s = serve.wait_ready()
        log_fn(f"serve ready after {ready_s} s: {serve.openai_url}")
        load = Load(serve.openai_url, prompts, {t.name: t.api_key for t in run.tenants} if keyed else {})
        watch = Watch(serve, 0.5 if run.mode == "burst" else 1.0).start(load.t0)
        last, kills = asyncio.run(drive(serve, load, run, mix))
        arrivals_s = last
        log_fn(f"load done: {len(load.results)} requests; {load.in_flight} unfinished")
        kv = kv_after(serve.metrics_url)
        alive = healthy(serve, model)
        watch.sample()
        exit_code, exit_s = serve.terminate()
        watch.stop()
        log_fn(f"serve exited with {exit_code} after {exit_s} s")
    finally:
        if serve.process.poll() is None:
            serve.kill_all()
    with open(log_dir / "requests.jsonl", "w") as out:
        out.writelines(json.dumps(r.to_json()) + "\n" for r in sorted(load.results, key=lambda r: r.index))
    window_end = load.now()
    restarts = [{"t_s": round(t - load.t0, 1), "child": c, "serving_again_s": s} for t, c, s in serve.restarts()]
    noteworthy = ("Error", "warning", "restart", "killed", "draining", "cut")
    payload = {
        "mode": run.mode, "label": run.label, "command": command, "serve_command": serve.command,
        "config": {**asdict(run), "engine": str(run.engine), "mix": asdict(mix), "describe": run.describe(mix),
                   "max_seq_len": max_seq_len},
        "workload": workload(mix, run.mode), "wall_s": round(time.monotonic() - started, 1),
        "load": {"arrivals_s": round(arrivals_s, 1), "retry_window_s": load.retry_window_s,
                 "read_timeout_s": load.read_timeout_s},
        "summary": summary(load.results),
        "tenants": tenant_summary(load.results, run.tenants) if run.tenants else None, "tenant_keys": keyed,
        "kills": kill_reports(kills, load.results, window_end),
        "server": {
            "ready_s": ready_s, "restarts": restarts, "exit_code": exit_code, "exit_s": exit_s,
            "serve_errors": [f"{t - load.t0:7.1f} s  {line}" for t, line in serve.lines
                             if any(word in line for word in noteworthy)],
            "crashes": crashes(serve, watch, since, log_dir), "sample_s": watch.interval_s,
            "peak_rss_mib": {k: round(v / 2**20) for k, v in watch.peaks.items()},
            "rss_timeline_mib": rss_timeline(watch),
            "kv_after": kv, "healthy_after": alive, "logs": str(log_dir),
            "cpu": cpu_use(busy0, client0, watch, started, quiet_before),
        },
    }  # fmt: skip
    return payload, load.results


def write(run: Run, payload: dict, results: list[Result]) -> Path:
    """results/<name>.json and .md, and the timeline PNG."""
    payload["targets"] = targets(payload)
    md, full = report.write_report(run.name, payload, render)
    timeline(full, results, md.with_suffix(".png"))
    return md


def execute(run: Run) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop serve too
    command = "python -m benchmarks.reliability " + shlex.join(sys.argv[1:])
    md = write(run, *measure(run, command))
    click.echo(md.read_text())


def common(f: Callable) -> Callable:
    options = [
        click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True),
        click.option("--backend", default=None, help="trtserve serve --backend (default: the engine's)."),
        click.option("--seed", default=0, show_default=True),
        click.option("--label", default=None, help="Results name suffix: reliability-<mode>-<label>."),
        click.option("--drain-wait-s", default=900.0, show_default=True,
                     help="After the last arrival, how long requests in flight are waited for before SIGTERM."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def traffic(f: Callable) -> Callable:
    f = click.option("--rate", default=1.0, show_default=True, help="Mean arrival rate, req/s (bursts reach 4/3).")(f)
    return f


@click.group()
def main() -> None:
    """Reliability of `trtserve serve` under mixed traffic, kills, and a burst of streams."""


@main.command()
@common
@traffic
@click.option("--duration-s", default=600.0, show_default=True, help="Seconds of arrivals.")
def soak(engine: Path, backend: str | None, seed: int, label: str | None, drain_wait_s: float, rate: float,
         duration_s: float) -> None:  # fmt: skip
    """Mixed traffic for --duration-s: lost requests, restarts, crashes, TTFT, peak RSS, exit code."""
    execute(Run("soak", engine, backend, rate, duration_s, seed, label, drain_wait_s))


@main.command(name="chaos")
@common
@traffic
@click.option(
    "--kills",
    default=",".join(KILLS),
    show_default=True,
    help=f"What to SIGKILL, in order; `{HANG}`: SIGSTOP the model's stub.",
)
@click.option("--warmup-s", default=60.0, show_default=True, help="Seconds of traffic before the first kill.")
@click.option("--settle-s", default=30.0, show_default=True, help="Seconds of traffic after each recovery.")
@click.option("--serve-args", default="", help="More `trtserve serve` options, e.g. '--standby --kv-disk-cache DIR'.")
def chaos_command(engine: Path, backend: str | None, seed: int, label: str | None, drain_wait_s: float, rate: float,
                  kills: str, warmup_s: float, settle_s: float, serve_args: str) -> None:  # fmt: skip
    """The soak's traffic while the model's stub, tritonserver and the gateway are killed in turn."""
    chosen = tuple(k for k in kills.split(",") if k)
    if unknown := set(chosen) - {*KILLS, HANG}:
        raise click.BadParameter(f"unknown {sorted(unknown)}; choose from {(*KILLS, HANG)}", param_hint="--kills")
    execute(Run("chaos", engine, backend, rate, 0.0, seed, label, drain_wait_s, kills=chosen, warmup_s=warmup_s,
                settle_s=settle_s, serve_args=tuple(shlex.split(serve_args))))  # fmt: skip


@main.command()
@common
@click.option("--streams", default=2000, show_default=True, type=click.IntRange(1))
@click.option(
    "--tenants",
    "tenants_spec",
    default="",
    help="name:streams[:max_queued],... in place of --streams: each tenant's streams with its own API key "
    "(and, with a third field, its own queue bound).",
)
@click.option(
    "--tenant-keys/--no-tenant-keys",
    default=True,
    show_default=True,
    help="--no-tenant-keys: the same tenants' traffic without keys, to an open gateway (the baseline).",
)
def burst(
    engine: Path,
    backend: str | None,
    seed: int,
    label: str | None,
    drain_wait_s: float,
    streams: int,
    tenants_spec: str,
    tenant_keys: bool,
) -> None:
    """--streams streaming requests at once: each completed or refused with a reason; KV all free after."""
    try:
        tenants = parse(tenants_spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--tenants") from None
    execute(
        Run(
            "burst",
            engine,
            backend,
            seed=seed,
            label=label,
            drain_wait_s=drain_wait_s,
            streams=streams,
            mix=Mix(answer_tokens=(16, 64)),
            tenants=tenants,
            tenant_keys=tenant_keys,
        )
    )


if __name__ == "__main__":
    main()

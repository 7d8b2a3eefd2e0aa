"""`python -m benchmarks.gateway`: the OpenAI gateway's own overhead -> results/gateway.{json,md,png}.

One tritonserver; the same closed-loop streaming workload at each concurrency through (a) the
gateway's /v1/completions and (b) Triton's generate_stream, both SSE from benchmarks/client.py,
interleaved a, b / b, a by repetition (drift cancels in pairs). Then NVIDIA aiperf (its own venv,
`bash benchmarks/peers/setup.sh aiperf`) profiles the gateway's /v1/chat/completions at the same
levels. /v1/completions, not chat, for the paired runs: it hands Triton the same `text_input` as
(b), so both paths run the same tokens (the client checks the server's prompt count).

Steady state (part `steady`): a sustained closed loop at c=32 (each client sends its next request as
soon as its previous one ends) over `steady_waves` x 32 requests, the first wave (32 requests sent at
once to an idle server) discarded, so TTFT is read with the pipeline full; paired like the levels.

    python -m benchmarks.gateway --engine /work/engines/smollm2-135m-b32
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from benchmarks import client, datasets, plots, prometheus, servers
from benchmarks.client import Endpoint
from benchmarks.cpu import machine_busy_s, pinned, session_affinity, session_cpu_s, wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.gateway_report import GATEWAY, QUIET_CPU_S, TRITON, overhead, render
from benchmarks.metrics import RequestRecord, summarize
from benchmarks.peers import aiperf
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_results
from benchmarks.suite import DEFAULT_SLO, Row, flatten

PARTS = ("paired", "steady", "aiperf", "vllm")
AIPERF_GATEWAY = "aiperf -> gateway /v1/chat/completions"


@dataclass(frozen=True)
class Config:
    engine: Path
    levels: tuple[int, ...] = (1, 8, 32)
    repetitions: int = 3
    input_len: int = 500
    output_len: int = 128
    requests_per_slot: int = 2
    min_requests: int = 4
    max_requests: int = 32  # caps the c=32 level at one wave (run time; see the README)
    probe: tuple[int, int, int] = (16, 8, 20)  # latency probe: prompt tokens, output tokens, requests at c=1
    aiperf_repetitions: int = 1
    steady_concurrency: int = 32
    steady_waves: int = 2  # requests = waves x concurrency; the first wave is discarded
    parts: tuple[str, ...] = PARTS
    pin: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (tritonserver's cores, the gateway's + client's)
    logs: Path = RESULTS_DIR / "logs" / "gateway"

    def requests(self, c: int) -> int:
        return min(self.max_requests, max(self.min_requests, self.requests_per_slot * c))

    def profile(self, c: int, prompt_len: int) -> aiperf.Profile:
        return aiperf.Profile(c, self.requests(c), prompt_len, self.output_len)


def steady_state(records: Sequence[RequestRecord], discard: int) -> tuple[list[RequestRecord], float]:
    """A closed loop's records after its first `discard` sends (the first wave, sent at once to an idle
    server), and the window they span: from the first kept send to the last end."""
    kept = sorted(records, key=lambda r: r.start)[discard:]
    if not kept:
        raise ValueError(f"nothing left after discarding the first {discard} of {len(records)} requests")
    return kept, max(r.end for r in kept) - min(r.start for r in kept)


def engine_ttft_s(samples: dict[str, float]) -> tuple[float, float]:
    """(sum of TTFT seconds, requests) of the engine's own TTFT histogram in one scrape."""
    name = "trtserve_time_to_first_token_seconds"
    return prometheus.total(samples, f"{name}_sum"), prometheus.total(samples, f"{name}_count")


def beyond_engine_ttft_ms(records: Sequence[RequestRecord], before: dict[str, float], after: dict[str, float]
                          ) -> float | None:  # fmt: skip
    """Mean client TTFT minus the engine's mean TTFT over the same requests (its histogram between two
    scrapes), ms: what the path outside the engine adds (HTTP or gateway + gRPC, Triton, the stub's IPC).
    Queueing in the engine cancels within the phase, so this difference is steady where TTFT itself
    swings by hundreds of ms between runs at c=32."""
    ok = [r.ttft for r in records if r.ok]
    (s0, n0), (s1, n1) = engine_ttft_s(before), engine_ttft_s(after)
    if not ok or n1 - n0 != len(ok):
        return None  # the engine saw other requests, or lost some: not comparable
    return round(1000 * (sum(ok) / len(ok) - (s1 - s0) / (n1 - n0)), 3)


def process_counters(pid: int) -> dict[str, float]:
    """A process's system CPU seconds and major page faults (/proc/<pid>/stat). Both jump when the machine
    is short of memory (library pages evicted and faulted back in, direct reclaim): the machine's state,
    counted in the process's CPU time but not its work, so reported next to it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on
    return {"sys_s": int(fields[12]) / os.sysconf("SC_CLK_TCK"), "major_faults": int(fields[9])}


def measure(send: client.Sender, prompts: list[BenchRequest], warm: list[BenchRequest], c: int,
            sessions: dict[str, int], metrics_url: str, discard: int = 0) -> dict:  # fmt: skip
    """Warm-up (not measured), then the measured phase with each server's CPU seconds over it;
    with `discard`, metrics only over the steady state after that many first sends."""
    asyncio.run(client.run_load(send, warm, concurrency=len(warm)))
    time.sleep(0.2)  # the warm-up's last histogram observations land
    before, machine = {name: session_cpu_s(pid) for name, pid in sessions.items()}, machine_busy_s()
    gateway_before = process_counters(sessions["gateway"])
    engine_before = prometheus.fetch(metrics_url)
    result = asyncio.run(client.run_load(send, prompts, concurrency=c))
    ours = sum(session_cpu_s(pid) - before[name] for name, pid in sessions.items()) + result.client_cpu_s
    gateway_after = process_counters(sessions["gateway"])
    time.sleep(0.2)
    beyond = beyond_engine_ttft_ms(result.records, engine_before, prometheus.fetch(metrics_url))
    records, duration = steady_state(result.records, discard) if discard else (result.records, result.duration_s)
    out = flatten(summarize(records, duration, DEFAULT_SLO))
    out["ttft_beyond_engine_ms"] = beyond  # over every request of the phase, the first wave included
    out["client_cpu_s"] = round(result.client_cpu_s, 2)
    out["multi_token_chunks"] = sum(n > 1 for r in result.records for n in r.chunk_tokens)  # see client.send_gateway
    for name, pid in sessions.items():
        out[f"{name}_cpu_s"] = round(session_cpu_s(pid) - before[name], 2)
    out["other_cpu_s"] = round(machine_busy_s() - machine - ours, 2)  # other helpers' work during the phase
    out["gateway_sys_s"] = round(gateway_after["sys_s"] - gateway_before["sys_s"], 2)  # part of gateway_cpu_s
    out["gateway_major_faults"] = gateway_after["major_faults"] - gateway_before["major_faults"]
    return out


def parse_pin(text: str | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """'0/1' -> ((0,), (1,)): the engine's cores, then the gateway's and the client's (disjoint)."""
    if not text:
        return None
    try:
        engine, front = ({int(c) for c in part.split(",")} for part in text.split("/"))
    except ValueError:
        raise click.BadParameter(f"--pin takes ENGINE_CORES/FRONT_CORES, e.g. 0/1 (got {text!r})") from None
    if engine & front or not (engine | front) <= os.sched_getaffinity(0):
        raise click.BadParameter(f"--pin {text}: two disjoint sets of this machine's cores")
    return tuple(sorted(engine)), tuple(sorted(front))


def placement(cfg: Config) -> str:
    if cfg.pin is None:
        return "unpinned: tritonserver, the gateway and the client share all cores"
    engine, front = (",".join(map(str, cores)) for cores in cfg.pin)
    return (
        f"pinned: tritonserver (its engine's threads sized to them) on core(s) {engine}; the gateway and the "
        f"client on core(s) {front}, so the gateway's own cost is measured without competing with the engine"
    )


def controls(cfg: Config, template_tokens: int) -> list[str]:
    p_in, p_out, p_n = cfg.probe
    return [
        "one tritonserver (fp32 engine, prefix caching OFF so both paths re-run every prompt), the gateway as "
        "`trtserve serve` starts it (python -m runtime.gateway, its own process, gRPC to Triton)",
        placement(cfg),
        f"same prompts for both paths at each level and repetition: {cfg.input_len} tokens -> exactly "
        f"{cfg.output_len} output tokens, EOS ignored, greedy; requests per level "
        + ", ".join(f"c{c}: {cfg.requests(c)}" for c in cfg.levels),
        f"latency probe: {p_n} requests of {p_in} -> {p_out} tokens at concurrency 1 (TTFT without load noise)",
        f"interleaved: per level, repetition r runs gateway then Triton (r even) or Triton then gateway (r odd); "
        f"{cfg.repetitions} repetitions; 2 warm-up requests (16 tokens out) before every measured phase",
        "client: benchmarks/client.py (aiohttp SSE, one event loop) for both paths; CPU seconds of the client, "
        "the gateway process and the tritonserver session (stubs included) per measured phase",
        "TTFT beyond the engine: per phase, the client's mean TTFT minus the engine's mean TTFT over the same "
        "requests (trtserve_time_to_first_token_seconds _sum/_count scraped before and after); the pair's "
        "difference is the TTFT the gateway adds, with the engine's queueing cancelled inside each phase",
        f"steady state: closed loop at c={cfg.steady_concurrency}, {cfg.steady_waves * cfg.steady_concurrency} "
        f"requests of the same shape, metrics over all but the first {cfg.steady_concurrency} sent (their window: "
        "first kept send to last end, so tok/s includes the drain); CPU seconds over the whole phase",
        f"aiperf: synthetic prompts of {cfg.input_len - template_tokens} tokens (+{template_tokens} of chat "
        f"template = {cfg.input_len}), {cfg.output_len} output tokens (ignore_eos, temperature 0), server token "
        f"counts, {cfg.aiperf_repetitions} run(s) per level after the paired runs",
    ]


def paired_runs(cfg: Config, tok, senders: dict[str, client.Sender], sessions: dict[str, int], metrics_url: str,
                extra: dict, log: Callable[[str], None], after_level: Callable[[int], None]) -> list[Row]:  # fmt: skip
    """The probe, then each level: both paths on the same prompts, alternating which goes first."""
    p_in, p_out, p_n = cfg.probe
    plan = [(f"latency probe {p_in} -> {p_out} tokens", "probe", 1, p_in, p_out, p_n)] + [
        (fixed_name(cfg), "concurrency", c, cfg.input_len, cfg.output_len, cfg.requests(c)) for c in cfg.levels
    ]
    if "paired" not in cfg.parts:
        plan = []
    c, waves = cfg.steady_concurrency, cfg.steady_waves
    if "steady" in cfg.parts and waves > 1:
        plan.append((f"steady state at c={c}: closed loop, {c * waves} requests, first {c} discarded "
                     f"({cfg.input_len} -> {cfg.output_len} tokens)", "steady", c, cfg.input_len, cfg.output_len,
                     c * waves))  # fmt: skip
    rows: list[Row] = []
    for seed, (workload, mode, c, n_in, n_out, n) in enumerate(plan):
        pair = {s: Row(workload, s, f"{mode} {c}", c) for s in (GATEWAY, TRITON)}
        rows += pair.values()
        for rep in range(cfg.repetitions):
            extra["quiet_waits_s"].append(wait_quiet(log))
            prompts = datasets.fixed(tok, n, n_in, n_out, seed=100 * seed + rep)
            extra["datasets"][f"{mode}{c}/rep{rep}"] = datasets.describe(prompts)
            warm = datasets.fixed(tok, 2, n_in, 16, seed=100 * seed + 50 + rep)
            for system in (GATEWAY, TRITON) if rep % 2 == 0 else (TRITON, GATEWAY):
                summary = measure(
                    senders[system], prompts, warm, c, sessions, metrics_url, c if mode == "steady" else 0
                )
                pair[system].reps.append(summary)
                log(
                    f"{system} | {mode} {c} | rep {rep}: {summary['output_tok_s']} tok/s, TTFT p50 "
                    f"{summary.get('ttft_ms_p50')} ms, failed {summary['failed']} {summary['errors']}"
                )
        if mode == "concurrency":
            after_level(c)
    return rows


def fixed_name(cfg: Config) -> str:
    return f"fixed {cfg.input_len} -> {cfg.output_len} tokens (EOS ignored)"


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32")
@click.option("--concurrency", default="1,8,32", show_default=True)
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--max-requests", default=32, show_default=True, help="Cap on requests per level.")
@click.option("--output-len", default=128, show_default=True)
@click.option("--aiperf-repetitions", default=1, show_default=True, type=click.IntRange(0))
@click.option("--steady-waves", default=2, show_default=True, type=click.IntRange(2),
              help="Steady-state part: waves x 32 requests in a closed loop, the first wave discarded.")  # fmt: skip
@click.option("--parts", default=",".join(PARTS), show_default=True, help=f"Subset of {','.join(PARTS)}.")
@click.option("--gateway-nice", default=None, type=int, help="The gateway's --nice (default: as `trtserve serve`).")
@click.option("--itl-target-ms", default=None, help="The engine's itl_target_ms ('0': the fixed token budget; "
              "default: the engine's SLO budget).")  # fmt: skip
@click.option(
    "--pin",
    default=None,
    metavar="ENGINE_CORES/FRONT_CORES",
    help="e.g. 0/1: tritonserver on core 0, the gateway and the client on core 1 (default: unpinned).",
)
@click.option("--name", default="gateway", show_default=True)
def main(engine: Path, concurrency: str, repetitions: int, max_requests: int, output_len: int,
         aiperf_repetitions: int, steady_waves: int, parts: str, gateway_nice: int | None, itl_target_ms: str | None,
         pin: str | None, name: str) -> None:  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer
    from runtime.gateway.process import BESIDE_ENGINE_NICE, GatewayProcess
    from runtime.serve.launcher import ServerConfig, TritonServer, free_port

    nice = BESIDE_ENGINE_NICE if gateway_nice is None else gateway_nice
    levels = tuple(int(x) for x in concurrency.split(",") if x)
    chosen = tuple(p for p in parts.split(",") if p)
    if unknown := set(chosen) - set(PARTS):
        raise click.BadParameter(f"unknown parts {sorted(unknown)} (choose from {', '.join(PARTS)})")
    cfg = Config(engine, levels, repetitions, output_len=output_len, max_requests=max_requests,
                 aiperf_repetitions=aiperf_repetitions if "aiperf" in chosen else 0, steady_waves=steady_waves,
                 parts=chosen, pin=parse_pin(pin), logs=RESULTS_DIR / "logs" / name)  # fmt: skip
    cfg.logs.mkdir(parents=True, exist_ok=True)
    tok, log = load_tokenizer(engine), lambda s: click.echo(s, err=True)
    chat = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    prompt_len = cfg.input_len - len(tok.encode(chat, add_special_tokens=False))  # aiperf's, before the template
    busy, started = cpu_busy_fraction(), time.time()
    server_cfg = ServerConfig.on_free_ports(
        engine,
        engine_params=servers.trtserve_params(
            engine, servers.ServingSettings(prefix_caching=False, itl_target_ms=itl_target_ms)
        ),
    )
    extra: dict = {"datasets": {}, "quiet_waits_s": []}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    model = engine.resolve().name  # as `trtserve serve` names it
    engine_cores, front_cores = cfg.pin or (None, None)
    with pinned(engine_cores):
        triton = TritonServer(server_cfg, cfg.logs / "tritonserver.log")
    with triton:
        triton.wait_ready()
        if front_cores is not None:  # this process (the client) and what it starts from here on: the gateway
            os.sched_setaffinity(0, front_cores)
        args = ["--triton-url", f"127.0.0.1:{server_cfg.grpc_port}", "--model", model, "--nice", str(nice)]
        with GatewayProcess(args, "127.0.0.1", free_port(), log_path=cfg.logs / "gateway.log") as gw:
            gw.wait_ready()
            ends = {GATEWAY: Endpoint("gateway", gw.url, model), TRITON: Endpoint("triton", server_cfg.http_url)}
            senders = {system: client.sender_for(end) for system, end in ends.items()}
            aiperf_rows: list[Row] = []

            def profile(c: int) -> None:  # aiperf on the gateway after each level's paired runs
                if cfg.aiperf_repetitions:
                    p = cfg.profile(c, prompt_len)
                    row = aiperf.row(fixed_name(cfg), AIPERF_GATEWAY, gw.url, model, engine, p, cfg.aiperf_repetitions,
                                     cfg.logs, log)  # fmt: skip
                    aiperf_rows.append(row)

            sessions = {"gateway": gw.process.pid, "triton": triton.process.pid}
            extra["affinity"] = {name: session_affinity(pid) for name, pid in sessions.items()}
            metrics_url = f"http://127.0.0.1:{server_cfg.metrics_port}/metrics"
            rows = paired_runs(cfg, tok, senders, sessions, metrics_url, extra, log, profile)
            if "paired" not in cfg.parts:
                for c in cfg.levels:
                    profile(c)
    rows += aiperf_rows
    if "vllm" in cfg.parts and cfg.aiperf_repetitions:
        profiles = [cfg.profile(c, prompt_len) for c in cfg.levels]
        rows += aiperf.vllm_rows(fixed_name(cfg), profiles, cfg.aiperf_repetitions, cfg.logs, log)
    extra["wall_s"] = round(time.time() - started, 1)
    as_json = [r.to_json() for r in rows]
    payload = {"command": "python -m benchmarks.gateway " + shlex.join(sys.argv[1:]),
               "config": {**asdict(cfg), "engine": str(engine), "logs": str(cfg.logs)},
               "controls": controls(cfg, cfg.input_len - prompt_len), "cpu_busy_before": busy, "rows": as_json,
               "overhead": overhead(as_json), "overhead_quiet": overhead(as_json, QUIET_CPU_S),
               "aiperf_version": aiperf.version(), **extra}  # fmt: skip
    md = write_results(name, payload, "")
    full = json.loads(md.with_suffix(".json").read_text())
    full["versions"]["aiperf"] = full["aiperf_version"]
    md.write_text(render(full))
    fixed_rows = [r for r in full["rows"] if r["workload"] == fixed_name(cfg) and r.get("median")]
    plots.throughput_vs_concurrency(fixed_rows, RESULTS_DIR / f"{name}_throughput_vs_concurrency.png")
    plots.latency_percentiles(fixed_rows, max(levels), RESULTS_DIR / f"{name}_latency_percentiles.png")
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

"""`python -m benchmarks.gateway`: the OpenAI gateway's own overhead -> results/gateway.{json,md,png}.

One tritonserver; the same closed-loop streaming workload at each concurrency through (a) the
gateway's /v1/completions and (b) Triton's generate_stream, both SSE from benchmarks/client.py,
interleaved a, b / b, a by repetition (drift cancels in pairs). Then NVIDIA aiperf (its own venv,
`bash benchmarks/peers/setup.sh aiperf`) profiles the gateway's /v1/chat/completions at the same
levels. /v1/completions, not chat, for the paired runs: it hands Triton the same `text_input` as
(b), so both paths run the same tokens (the client checks the server's prompt count).

    python -m benchmarks.gateway --engine /work/engines/smollm2-135m-b32
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import click

from benchmarks import client, datasets, plots, servers, tables
from benchmarks.client import Endpoint
from benchmarks.datasets import BenchRequest
from benchmarks.metrics import RequestRecord, summarize
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_results
from benchmarks.suite import DEFAULT_SLO, Row, flatten

AIPERF = servers.VENVS / "aiperf" / "bin" / "aiperf"
GATEWAY = "gateway /v1/completions (SSE) -> Triton gRPC"
TRITON = "Triton generate_stream (SSE, direct)"
AIPERF_GATEWAY = "aiperf -> gateway /v1/chat/completions"
TTFT_TARGET_MS, THROUGHPUT_TARGET = 10.0, 0.95  # issue 14, at the highest level
QUIET_CPU_S = 2.0  # a pair counts as undisturbed when other processes used at most this in each phase


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
    logs: Path = RESULTS_DIR / "logs" / "gateway"

    def requests(self, c: int) -> int:
        return min(self.max_requests, max(self.min_requests, self.requests_per_slot * c))


async def send_gateway(session: aiohttp.ClientSession, endpoint: Endpoint, req: BenchRequest) -> RequestRecord:
    """The gateway's /v1/completions with the text prompt. It has no per-chunk usage, so every chunk
    counts as one token (one upstream delta each) and the final usage chunk settles the total: a
    mismatch shows up as a multi-token last chunk or a length error, never silently."""
    body = {"model": endpoint.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": req.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = 0

    def counts(event: dict) -> dict:
        nonlocal chunks
        if event.get("usage"):
            return event["usage"]
        chunks += len(event.get("choices", []))
        return {"completion_tokens": chunks}

    return await client._stream(session, f"{endpoint.url}/v1/completions", body, req, counts)


def session_cpu_s(leader: int) -> float:
    """CPU seconds of every live process in `leader`'s session (tritonserver + its Python stubs)."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == leader:  # field 6 (session id), counted after the command name
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / tick


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(log: Callable[[str], None], limit_s: float = 90.0, busy: float = 0.2) -> float:
    """Wait (up to limit_s) until other work stops: helpers share these 2 cores. Returns seconds waited."""
    start = time.monotonic()
    while (share := cpu_busy_fraction(2.0)) is not None and share > busy and time.monotonic() - start < limit_s:
        log(f"  machine {share:.0%} busy with other work; waiting")
    return round(time.monotonic() - start, 1)


def measure(send: client.Sender, prompts: list[BenchRequest], warm: list[BenchRequest], c: int,
            sessions: dict[str, int]) -> dict:  # fmt: skip
    """Warm-up (not measured), then the measured phase with each server's CPU seconds over it."""
    asyncio.run(client.run_load(send, warm, concurrency=len(warm)))
    before, machine = {name: session_cpu_s(pid) for name, pid in sessions.items()}, machine_busy_s()
    result = asyncio.run(client.run_load(send, prompts, concurrency=c))
    ours = sum(session_cpu_s(pid) - before[name] for name, pid in sessions.items()) + result.client_cpu_s
    out = flatten(summarize(result.records, result.duration_s, DEFAULT_SLO))
    out["client_cpu_s"] = round(result.client_cpu_s, 2)
    out["multi_token_chunks"] = sum(n > 1 for r in result.records for n in r.chunk_tokens)  # see send_gateway
    for name, pid in sessions.items():
        out[f"{name}_cpu_s"] = round(session_cpu_s(pid) - before[name], 2)
    out["other_cpu_s"] = round(machine_busy_s() - machine - ours, 2)  # other helpers' work during the phase
    return out


def aiperf_summary(export: dict) -> dict:
    """aiperf's profile_export_aiperf.json in this suite's keys. Its per-request "inter token latency",
    (latency - TTFT) / (tokens - 1), is our TPOT; its inter-chunk latency (every gap) is our ITL."""
    get = lambda metric, stat="avg": export.get(metric, {}).get(stat)  # noqa: E731
    out = {"output_tok_s": get("output_token_throughput"), "request_s": get("request_throughput"),
           "tpot_ms_p50": get("inter_token_latency", "p50"), "failed": get("error_request_count") or 0,
           "prompt_tokens_mean": get("input_sequence_length")}  # fmt: skip
    for ours, theirs in (("ttft_ms", "time_to_first_token"), ("itl_ms", "inter_chunk_latency"),
                         ("e2e_ms", "request_latency")):  # fmt: skip
        out |= {f"{ours}_p{q}": get(theirs, f"p{q}") for q in (50, 90, 99)}
    return {k: round(float(v), 3) for k, v in out.items() if v is not None}


def run_aiperf(url: str, model: str, tokenizer_dir: Path, c: int, n: int, cfg: Config, prompt_len: int,
               out_dir: Path) -> dict:  # fmt: skip
    """One aiperf profile (synthetic prompts of `prompt_len` tokens before the chat template)."""
    command = [str(AIPERF), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
               "--tokenizer", str(tokenizer_dir), "--concurrency", str(c), "--request-count", str(n),
               "--warmup-request-count", "2", "--prompt-input-tokens-mean", str(prompt_len),
               "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(cfg.output_len),
               "--prompt-output-tokens-stddev", "0", "--extra-inputs", '{"ignore_eos": true, "temperature": 0.0}',
               "--use-server-token-count", "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
               "--random-seed", str(c), "--output-artifact-dir", str(out_dir)]  # fmt: skip
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out_dir.with_suffix(".log"), "wb") as log:  # not HF_HUB_OFFLINE: aiperf 0.13 then misreads a path
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    export = out_dir / "profile_export_aiperf.json"
    if proc.returncode != 0 or not export.exists():
        raise RuntimeError(f"aiperf exited {proc.returncode}; log {out_dir.with_suffix('.log')}")
    summary = aiperf_summary(json.loads(export.read_text()))
    summary["client_cpu_s"] = round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2)
    return summary


def overhead(rows: list[dict], max_other_cpu_s: float | None = None) -> list[dict]:
    """Gateway vs direct Triton per mode (probe, each level), paired by repetition (they ran back to back).
    max_other_cpu_s: keep only pairs in which other processes used at most this much CPU in either phase."""
    pairs: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["system"] in (GATEWAY, TRITON) and r["reps"]:
            pairs.setdefault(r["mode"], {})[r["system"]] = r
    out = []
    for mode, pick in pairs.items():
        if len(pick) < 2:
            continue
        reps = [
            (g, t)
            for g, t in zip(pick[GATEWAY]["reps"], pick[TRITON]["reps"], strict=False)
            if max_other_cpu_s is None or max(g.get("other_cpu_s", 0), t.get("other_cpu_s", 0)) <= max_other_cpu_s
        ]
        if not reps:
            continue
        values = {
            "throughput_ratio": [g["output_tok_s"] / t["output_tok_s"] for g, t in reps],
            "ttft_p50_delta_ms": [g["ttft_ms_p50"] - t["ttft_ms_p50"] for g, t in reps],
            "ttft_p99_delta_ms": [g["ttft_ms_p99"] - t["ttft_ms_p99"] for g, t in reps],
            "itl_p50_delta_ms": [g["itl_ms_p50"] - t["itl_ms_p50"] for g, t in reps],
            "gateway_cpu_ms_per_token": [1000 * g["gateway_cpu_s"] / max(g["output_tokens"], 1) for g, _ in reps],
            "other_cpu_s": [max(g.get("other_cpu_s", 0), t.get("other_cpu_s", 0)) for g, t in reps],
        }
        entry: dict = {"mode": mode, "pairs": len(reps)}
        for name, v in values.items():
            entry[name] = [round(statistics.median(v), 4), round(min(v), 4), round(max(v), 4)]
        out.append(entry)
    return out


def verdict(entry: dict) -> str:
    ratio, ttft = entry.get("throughput_ratio"), entry.get("ttft_p50_delta_ms")
    if not ratio or not ttft:
        return "not measured"
    ok_tp, ok_ttft = ratio[0] >= THROUGHPUT_TARGET, ttft[0] < TTFT_TARGET_MS
    return (f"throughput {'met' if ok_tp else 'MISSED'} (≥ {THROUGHPUT_TARGET:g}), TTFT p50 "
            f"{'met' if ok_ttft else 'MISSED'} (< {TTFT_TARGET_MS:g} ms)")  # fmt: skip


def overhead_table(entries: list[dict]) -> list[str]:
    cell = lambda v, d=3: "-" if not v else f"{v[0]:.{d}f} ({v[1]:.{d}f}–{v[2]:.{d}f})"  # noqa: E731
    lines = ["| mode | pairs | throughput ratio | TTFT p50 Δ ms | TTFT p99 Δ ms | ITL p50 Δ ms | gateway CPU ms/token "
             "| other work, CPU s | targets |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in entries:
        lines.append(f"| {e['mode']} | {e['pairs']} | {cell(e.get('throughput_ratio'))} | "
                     f"{cell(e.get('ttft_p50_delta_ms'), 1)} | {cell(e.get('ttft_p99_delta_ms'), 1)} | "
                     f"{cell(e.get('itl_p50_delta_ms'), 2)} | {cell(e.get('gateway_cpu_ms_per_token'), 2)} | "
                     f"{cell(e.get('other_cpu_s'), 1)} | {verdict(e)} |")  # fmt: skip
    return lines


def render(payload: dict) -> str:
    m = payload["machine"]
    lines = ["# Gateway overhead (issue 14)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; run {payload['date_utc']}, "
             f"{payload['wall_s']:.0f} s wall. Command: `{payload['command']}`",
             f"CPU busy in the 3 s before the run: {payload['cpu_busy_before']}.", "",
             "Controls: " + "; ".join(payload["controls"]), "",
             "## Overhead: gateway vs direct Triton, paired by repetition", "",
             "Median (min–max) over repetitions of the per-repetition ratio or difference (gateway − Triton). "
             "Other work: CPU seconds other processes used during the pair's busier phase (helpers share the "
             f"machine; waits for quiet before repetitions: {payload['quiet_waits_s']} s).", "",
             *overhead_table(payload["overhead"]), "", f"Only pairs with <= {QUIET_CPU_S} CPU s of other work:", "",
             *overhead_table(payload["overhead_quiet"])]  # fmt: skip
    by_workload: dict[str, list[dict]] = {}
    for row in payload["rows"]:
        by_workload.setdefault(row["workload"], []).append(row)
    slo = {"ttft_s": DEFAULT_SLO.ttft_s, "tpot_s": DEFAULT_SLO.tpot_s}
    for workload, rows in by_workload.items():
        lines += ["", f"## {workload}", "", *tables.workload_table(rows, slo)]
    versions = ", ".join(f"{k} {v}" for k, v in payload["versions"].items() if v)
    return "\n".join([*lines, "", "## Versions", "", versions, ""])


def controls(cfg: Config, template_tokens: int) -> list[str]:
    p_in, p_out, p_n = cfg.probe
    return [
        "one tritonserver (fp32 engine, prefix caching OFF so both paths re-run every prompt), the gateway as "
        "`trtserve serve` starts it (python -m runtime.gateway, its own process, gRPC to Triton)",
        f"same prompts for both paths at each level and repetition: {cfg.input_len} tokens -> exactly "
        f"{cfg.output_len} output tokens, EOS ignored, greedy; requests per level "
        + ", ".join(f"c{c}: {cfg.requests(c)}" for c in cfg.levels),
        f"latency probe: {p_n} requests of {p_in} -> {p_out} tokens at concurrency 1 (TTFT without load noise)",
        f"interleaved: per level, repetition r runs gateway then Triton (r even) or Triton then gateway (r odd); "
        f"{cfg.repetitions} repetitions; 2 warm-up requests (16 tokens out) before every measured phase",
        "client: benchmarks/client.py (aiohttp SSE, one event loop) for both paths; CPU seconds of the client, "
        "the gateway process and the tritonserver session (stubs included) per measured phase",
        f"aiperf: synthetic prompts of {cfg.input_len - template_tokens} tokens (+{template_tokens} of chat "
        f"template = {cfg.input_len}), {cfg.output_len} output tokens (ignore_eos, temperature 0), server token "
        f"counts, {cfg.aiperf_repetitions} run(s) per level after the paired runs",
    ]


def paired_runs(cfg: Config, tok, senders: dict[str, client.Sender], sessions: dict[str, int], extra: dict,
                log: Callable[[str], None], after_level: Callable[[int], None]) -> list[Row]:  # fmt: skip
    """The probe, then each level: both paths on the same prompts, alternating which goes first."""
    p_in, p_out, p_n = cfg.probe
    plan = [(f"latency probe {p_in} -> {p_out} tokens", "probe", 1, p_in, p_out, p_n)] + [
        (fixed_name(cfg), "concurrency", c, cfg.input_len, cfg.output_len, cfg.requests(c)) for c in cfg.levels
    ]
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
                summary = measure(senders[system], prompts, warm, c, sessions)
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


def aiperf_row(system: str, url: str, model: str, tokenizer_dir: Path, cfg: Config, c: int, prompt_len: int,
               log: Callable[[str], None], quiet: bool = True) -> Row:  # fmt: skip
    row = Row(fixed_name(cfg), system, f"concurrency {c}", c)
    if not AIPERF.exists():
        row.unavailable = "aiperf is not installed: bash benchmarks/peers/setup.sh aiperf"
    for rep in range(cfg.aiperf_repetitions if not row.unavailable else 0):
        out = cfg.logs / f"aiperf-{model}-c{c}-rep{rep}"
        if quiet:  # not for vLLM: its CPU worker polls (~60% of a core) even while idle
            wait_quiet(log)
        try:
            row.reps.append(run_aiperf(url, model, tokenizer_dir, c, cfg.requests(c), cfg, prompt_len, out))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            row.unavailable = str(exc)
            break
        log(f"{system} | c{c} | rep {rep}: {row.reps[-1]}")
    return row


def vllm_rows(cfg: Config, prompt_len: int, log: Callable[[str], None]) -> list[Row]:
    """aiperf against vLLM's OpenAI server, only where its peer venv already exists."""
    system = "aiperf -> vLLM OpenAI server /v1/chat/completions"
    if not (servers.VENVS / "vllm" / ".done").exists():
        return [Row(fixed_name(cfg), system, "-", 0, unavailable="benchmarks/.venvs/vllm/.done is absent; installing "
                    "vLLM (bash benchmarks/peers/setup.sh vllm, ~25 min) was left out of this run")]  # fmt: skip
    from builder.sources import resolve_model

    checkpoint = resolve_model("smollm2-135m").checkpoint_dir
    settings = servers.ServingSettings(prefix_caching=False)
    with servers.vllm(checkpoint, settings, cfg.logs / "vllm.log") as ep:
        return [aiperf_row(system, ep.url, ep.model, checkpoint, cfg, c, prompt_len, log, False) for c in cfg.levels]


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32")
@click.option("--concurrency", default="1,8,32", show_default=True)
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--max-requests", default=32, show_default=True, help="Cap on requests per level.")
@click.option("--output-len", default=128, show_default=True)
@click.option("--aiperf-repetitions", default=1, show_default=True, type=click.IntRange(0))
@click.option("--name", default="gateway", show_default=True)
def main(engine: Path, concurrency: str, repetitions: int, max_requests: int, output_len: int,
         aiperf_repetitions: int, name: str) -> None:  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer
    from runtime.gateway.process import GatewayProcess
    from runtime.serve.launcher import ServerConfig, TritonServer, free_port

    levels = tuple(int(x) for x in concurrency.split(",") if x)
    cfg = Config(engine, levels, repetitions, output_len=output_len, max_requests=max_requests,
                 aiperf_repetitions=aiperf_repetitions, logs=RESULTS_DIR / "logs" / name)  # fmt: skip
    cfg.logs.mkdir(parents=True, exist_ok=True)
    tok, log = load_tokenizer(engine), lambda s: click.echo(s, err=True)
    chat = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    template = len(tok.encode(chat, add_special_tokens=False))  # what aiperf's chat prompts gain on the server
    busy, started = cpu_busy_fraction(), time.time()
    server_cfg = ServerConfig.on_free_ports(
        engine, engine_params=servers.trtserve_params(engine, servers.ServingSettings(prefix_caching=False))
    )
    extra: dict = {"datasets": {}, "quiet_waits_s": []}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    model = engine.resolve().name  # as `trtserve serve` names it
    with TritonServer(server_cfg, cfg.logs / "tritonserver.log") as triton:
        triton.wait_ready()
        args = ["--triton-url", f"127.0.0.1:{server_cfg.grpc_port}", "--model", model]
        with GatewayProcess(args, "127.0.0.1", free_port(), log_path=cfg.logs / "gateway.log") as gw:
            gw.wait_ready()
            ends = {GATEWAY: Endpoint("openai", gw.url, model), TRITON: Endpoint("triton", server_cfg.http_url)}
            senders = {GATEWAY: lambda s, r: send_gateway(s, ends[GATEWAY], r), TRITON: client.sender_for(ends[TRITON])}
            aiperf_rows: list[Row] = []
            rows = paired_runs(cfg, tok, senders, {"gateway": gw.process.pid, "triton": triton.process.pid}, extra,
                               log, lambda c: aiperf_rows.append(
                                   aiperf_row(AIPERF_GATEWAY, gw.url, model, engine, cfg, c, cfg.input_len - template,
                                              log)))  # fmt: skip
    rows += aiperf_rows + vllm_rows(cfg, cfg.input_len - template, log)
    extra["wall_s"] = round(time.time() - started, 1)
    as_json = [r.to_json() for r in rows]
    payload = {"command": "python -m benchmarks.gateway " + shlex.join(sys.argv[1:]),
               "config": {**asdict(cfg), "engine": str(engine), "logs": str(cfg.logs)},
               "controls": controls(cfg, template), "cpu_busy_before": busy, "rows": as_json,
               "overhead": overhead(as_json), "overhead_quiet": overhead(as_json, QUIET_CPU_S),
               "aiperf_version": _aiperf_version(), **extra}  # fmt: skip
    md = write_results(name, payload, "")
    full = json.loads(md.with_suffix(".json").read_text())
    full["versions"]["aiperf"] = full["aiperf_version"]
    md.write_text(render(full))
    fixed_rows = [r for r in full["rows"] if r["workload"] == fixed_name(cfg) and r.get("median")]
    plots.throughput_vs_concurrency(fixed_rows, RESULTS_DIR / f"{name}_throughput_vs_concurrency.png")
    plots.latency_percentiles(fixed_rows, max(levels), RESULTS_DIR / f"{name}_latency_percentiles.png")
    click.echo(md.read_text())


def _aiperf_version() -> str | None:
    run = subprocess.run([str(AIPERF), "--version"], capture_output=True, text=True) if AIPERF.exists() else None
    return run.stdout.strip() if run else None


if __name__ == "__main__":
    main()

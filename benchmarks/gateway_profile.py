"""`python -m benchmarks.gateway_profile`: the gateway's CPU cost, per streamed token and per request.

A quick A/B tool for work on the gateway's hot path (the full `benchmarks.gateway` run takes ~10 min).
One upstream: a real tritonserver, or with --fake-step-ms benchmarks.gateway_fake_triton (no engine: the
gateway has the cores to itself, and the numbers are steady). One gateway from this tree and, with
--baseline, one from another checkout (e.g. `git archive HEAD | tar -x -C /tmp/gw-base`), both in front
of it, alternating by round (A, B / B, A). Each round runs, per gateway, a long phase (output_len tokens)
and a short one (1 token) at the same concurrency. The gateway process's CPU seconds over each phase
(/proc: robust to other work on the machine), less its idle rate (uvicorn's ticks, health probes, gRPC's
threads: measured first, charged by wall time) give, by the two-phase fit
cpu = requests * (per_request + tokens_per_request * per_token), its fixed and per-token costs.

    python -m benchmarks.gateway_profile --engine /work/engines/smollm2-135m-b32 --baseline /tmp/gw-base
    python -m benchmarks.gateway_profile --engine ... --fake-step-ms 20 --py-spy /tmp/spy
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import click

from benchmarks import client, datasets, prometheus, servers
from benchmarks.cpu import session_cpu_s
from benchmarks.gateway import beyond_engine_ttft_ms

IDLE_S = 5.0
FIT_KEYS = (
    "cpu_ms_per_token_all_in",
    "user_cpu_ms_per_token_all_in",
    "cpu_ms_per_token",
    "cpu_ms_per_request",
    "ttft_ms_mean",
    "major_faults",
)


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None, native: bool) -> Iterator[None]:
    """Sample the gateway with py-spy while the block runs (without `native`, non-blocking: not paused)."""
    if out is None:
        yield
        return
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")  # pip-installed in the venv
    command = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", str(out), "--rate", "250"]
    mode = ["--native"] if native else ["--nonblocking"]  # native stacks need the process paused per sample
    spy = subprocess.Popen([*command, *mode], stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the load starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its profile and exits
        spy.wait(60)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (the main thread is "python"; gRPC's core threads have their own)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def idle_rate(pid: int) -> float:
    """The gateway's CPU seconds per second with no request open."""
    cpu0 = session_cpu_s(pid)
    time.sleep(IDLE_S)
    return (session_cpu_s(pid) - cpu0) / IDLE_S


def counters(pid: int) -> dict[str, float]:
    """The process's user and system CPU seconds and major page faults (/proc/<pid>/stat). System time and
    major faults jump when the machine is short of memory (library pages evicted, then faulted back in,
    direct reclaim): that is the machine's state, not the gateway's work, so it is reported apart."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on
    tick = os.sysconf("SC_CLK_TCK")
    return {"user_s": int(fields[11]) / tick, "sys_s": int(fields[12]) / tick, "major_faults": int(fields[9])}


def phase(end: client.Endpoint, pid: int, prompts: list, concurrency: int, metrics_url: str | None) -> dict:
    send = client.sender_for(end)
    engine0 = prometheus.fetch(metrics_url) if metrics_url else {}
    cpu0, threads0, before = session_cpu_s(pid), thread_cpu_s(pid), counters(pid)
    result = asyncio.run(client.run_load(send, prompts, concurrency=concurrency))
    cpu, threads, after = session_cpu_s(pid) - cpu0, thread_cpu_s(pid), counters(pid)
    failed = [r.error for r in result.records if not r.ok]
    ttfts = [r.ttft for r in result.records if r.ok]
    out = {
        "cpu_s": round(cpu, 3),
        **{k: round(after[k] - before[k], 3) for k in after},
        "requests": len(prompts),
        "tokens": sum(r.output_tokens for r in result.records),
        "failed": len(failed),
        "errors": failed[:2],
        "wall_s": round(result.duration_s, 2),
        "ttft_ms_mean": round(1000 * statistics.mean(ttfts), 2) if ttfts else None,
        "threads_cpu_s": {
            k: round(v - threads0.get(k, 0.0), 2) for k, v in threads.items() if v > threads0.get(k, 0.0)
        },
    }
    if metrics_url:
        time.sleep(0.2)  # the engine's last histogram observations land
        out["ttft_beyond_engine_ms"] = beyond_engine_ttft_ms(result.records, engine0, prometheus.fetch(metrics_url))
    return out


def fit(long: dict, short: dict, idle: float) -> dict:
    """Per-request and per-token CPU ms from a long and a short phase of the same request count."""
    busy = {p: (x["cpu_s"] - idle * x["wall_s"]) / x["requests"] for p, x in (("long", long), ("short", short))}
    tokens = {p: x["tokens"] / x["requests"] for p, x in (("long", long), ("short", short))}
    per_token = (busy["long"] - busy["short"]) / (tokens["long"] - tokens["short"])
    return {
        "cpu_ms_per_token_all_in": round(1000 * long["cpu_s"] / long["tokens"], 4),
        "user_cpu_ms_per_token_all_in": round(1000 * long["user_s"] / long["tokens"], 4),
        "major_faults": long["major_faults"] + short["major_faults"],
        "cpu_ms_per_token": round(1000 * per_token, 4),
        "cpu_ms_per_request": round(1000 * (busy["short"] - per_token * tokens["short"]), 3),
        "ttft_ms_mean": short["ttft_ms_mean"],
        **{k: v for k, v in (("ttft_beyond_engine_ms", long.get("ttft_beyond_engine_ms")),
                             ("ttft_beyond_engine_ms_short", short.get("ttft_beyond_engine_ms"))) if v is not None},
    }  # fmt: skip


class Server(NamedTuple):
    grpc_port: int
    metrics_url: str | None  # the engine's (None: the fake)
    direct: client.Endpoint | None  # Triton's own HTTP streaming endpoint (None: the fake)
    pid: int


@contextlib.contextmanager
def upstream(engine: Path, fake_step_ms: float | None, prompts: list) -> Iterator[Server]:
    """A tritonserver, or the fake one."""
    from runtime.serve.launcher import ServerConfig, TritonServer, free_port

    if fake_step_ms is None:
        params = servers.trtserve_params(engine, servers.ServingSettings(prefix_caching=False))
        config = ServerConfig.on_free_ports(engine, engine_params=params)
        with TritonServer(config) as triton:
            triton.wait_ready(timeout_s=300)
            metrics_url = f"http://127.0.0.1:{config.metrics_port}/metrics"
            yield Server(config.grpc_port, metrics_url, client.Endpoint("triton", config.http_url), triton.process.pid)
        return
    port, counts = free_port(), Path(tempfile.mkstemp(suffix=".json")[1])
    counts.write_text(json.dumps({p.prompt: len(p.prompt_ids) for p in prompts}))
    command = [sys.executable, "-m", "benchmarks.gateway_fake_triton", "--port", str(port), "--step-ms",
               str(fake_step_ms), "--engine", str(engine), "--prompt-counts", str(counts)]  # fmt: skip
    fake = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None and "listening" in fake.stdout.readline()
        yield Server(port, None, None, fake.pid)
    finally:
        fake.terminate()
        fake.wait(10)
        counts.unlink()


@contextlib.contextmanager
def gateway_process(args: list[str], tree: Path, pythonpath: str) -> Iterator:
    """A gateway from checkout `tree`, `pythonpath` ahead of the venv's packages (GatewayProcess copies the
    environment it starts with)."""
    from runtime.gateway.process import GatewayProcess
    from runtime.serve.launcher import free_port

    saved = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        process = GatewayProcess(args, "127.0.0.1", free_port(), cwd=tree)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    with process:
        yield process


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), required=True)
@click.option(
    "--baseline",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Another checkout whose gateway runs alternately with this tree's.",
)
@click.option("--variant", "variants", multiple=True, metavar="NAME=TREE[:PYTHONPATH]",
              help="One more gateway: from checkout TREE, PYTHONPATH prepended (e.g. other packages).")  # fmt: skip
@click.option("--fake-step-ms", type=float, default=None, help="Fake upstream: one token per stream every this.")
@click.option("--concurrency", default=32, show_default=True)
@click.option("--requests", "count", default=32, show_default=True)
@click.option("--input-len", default=500, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--py-spy", "spy_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Record each gateway's phases with py-spy (raw collapsed stacks) into this folder.")  # fmt: skip
@click.option("--native", is_flag=True, help="py-spy --native (C frames too).")
@click.option("--direct", is_flag=True, help="Each round, the same phases on Triton's own HTTP stream too: "
              "the reference for the TTFT the gateway adds (real upstream only).")  # fmt: skip
def main(engine: Path, baseline: Path | None, variants: tuple[str, ...], fake_step_ms: float | None,
         concurrency: int, count: int, input_len: int, output_len: int, rounds: int, spy_dir: Path | None,
         native: bool, direct: bool) -> None:  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer

    tok, model = load_tokenizer(engine), engine.resolve().name
    trees = {"current": (Path.cwd(), ""), **({"baseline": (baseline.resolve(), "")} if baseline else {})}
    for variant in variants:
        name, _, where = variant.partition("=")
        tree, _, path = where.partition(":")
        trees[name] = (Path(tree).resolve(), path)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    if spy_dir:
        spy_dir.mkdir(parents=True, exist_ok=True)
    plans = [{"long": datasets.fixed(tok, count, input_len, output_len, seed=rnd),
              "short": datasets.fixed(tok, count, input_len, 1, seed=50 + rnd),
              "warm": datasets.fixed(tok, 2, input_len, 16, seed=90 + rnd)} for rnd in range(rounds)]  # fmt: skip
    with contextlib.ExitStack() as stack:
        every = [p for plan in plans for prompts in plan.values() for p in prompts]
        server = stack.enter_context(upstream(engine, fake_step_ms, every))
        metrics_url = server.metrics_url
        args = ["--triton-url", f"127.0.0.1:{server.grpc_port}", "--model", model]
        gateways = {
            name: stack.enter_context(gateway_process(args, tree, path)) for name, (tree, path) in trees.items()
        }
        for gw in gateways.values():
            gw.wait_ready()
        idle = {name: idle_rate(gw.process.pid) for name, gw in gateways.items()}
        click.echo(f"idle CPU s/s: {idle}", err=True)
        ends = {name: client.Endpoint("gateway", gw.url, model) for name, gw in gateways.items()}
        pids = {name: gw.process.pid for name, gw in gateways.items()}
        if direct and server.direct is not None:
            ends["triton-direct"], pids["triton-direct"], idle["triton-direct"] = server.direct, server.pid, 0.0
            results["triton-direct"] = []
        for rnd, plan in enumerate(plans):
            for name in list(ends) if rnd % 2 == 0 else list(reversed(ends)):
                end, pid = ends[name], pids[name]
                asyncio.run(client.run_load(client.sender_for(end), plan["warm"], 2))
                spies = {p: spy_dir / f"{name}-{rnd}-{p}.txt" if spy_dir else None for p in ("long", "short")}
                with py_spy(pid, spies["long"], native):
                    a = phase(end, pid, plan["long"], concurrency, metrics_url)
                with py_spy(pid, spies["short"], native):
                    b = phase(end, pid, plan["short"], concurrency, metrics_url)
                results[name].append({**fit(a, b, idle[name]), "long": a, "short": b})
                click.echo(f"round {rnd} {name}: {json.dumps(results[name][-1])}", err=True)
    keys = {name: FIT_KEYS if name in gateways else FIT_KEYS[-3:] for name in results}  # direct: its TTFTs only
    summary = {
        name: {k: round(statistics.median(r[k] for r in runs), 4) for k in keys[name] if runs[0].get(k) is not None}
        for name, runs in results.items()
    }
    for name in gateways if "triton-direct" in results else ():  # paired by round, as benchmarks.gateway
        for key in ("ttft_beyond_engine_ms", "ttft_beyond_engine_ms_short"):
            added = [g[key] - d[key] for g, d in zip(results[name], results["triton-direct"], strict=True)
                     if g.get(key) is not None and d.get(key) is not None]  # fmt: skip
            if added:
                summary[name][key.replace("beyond_engine", "added")] = round(statistics.median(added), 2)
    click.echo(json.dumps({"summary": summary, "idle_cpu_s_per_s": idle, "runs": results}, indent=1))


if __name__ == "__main__":
    main()

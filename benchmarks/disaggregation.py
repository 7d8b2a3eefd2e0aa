"""`python -m benchmarks.disaggregation`: prefill/decode disaggregation -> results/disaggregation.{json,md}.

Systems behind the same gateway, the same traffic for each, one after the other (`--systems`):
- "both": one `both` worker (tritonserver + the trtserve model) on the machine's 2 cores;
- "disaggregated": a prefill worker pinned to core 0 and a decode worker pinned to core 1 (each engine then
  runs one thread: the backends size their threads by the process' affinity), KV moved by NIXL (UCX over
  shared memory: host DRAM to host DRAM);
- "disaggregated-thread": the same with each worker's engine core on a thread of its model's process
  (`--no-engine-process`) instead of a process of its own.
The gateway and the load generator float over both cores in both runs (the gateway at nice 10, as `trtserve
serve` starts it).

Traffic: `streams` steady decodes (short prompts, long answers, EOS ignored, back to back in a closed loop),
into which long prompts (`long_tokens` tokens, a few output tokens) arrive as a Poisson process. What a user
of the steady streams sees is their inter-token latency, p50 and p99: on one worker a long prompt's prefill
chunks share steps with every decode (the SLO budget caps each step at the ITL target, so the stall is
bounded but not gone); disaggregated, no decode step carries a prefill. What the long prompts' users see is
TTFT. Goodput counts requests meeting TTFT <= 5 s and TPOT <= 200 ms; output tok/s counts both kinds.

Transfer: the decode worker's own counters (bytes read, seconds per read: trtserve_kv_transfer_*) give the
bandwidth and the time per request; a plain memory copy of the same blocks (numpy, one process: a gather of
the request's blocks from a pool laid out as the engine's, and one contiguous copy) is the ceiling.

    python -m benchmarks.disaggregation --engine /tmp/engines/smollm2-135m [--duration 90]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import click
import numpy as np

from benchmarks import datasets, prometheus
from benchmarks.client import Endpoint, send_gateway
from benchmarks.datasets import BenchRequest
from benchmarks.disaggregation_report import render
from benchmarks.metrics import SLO, RequestRecord, summarize
from benchmarks.report import cpu_busy_fraction, write_report
from engine_format import EngineConfig
from engine_format.kv_cache import bytes_per_token
from runtime.engine.tokenizer import load_tokenizer
from runtime.gateway.process import GatewayProcess
from runtime.serve.launcher import ServerConfig, TritonServer, free_port

GOODPUT_SLO = SLO(ttft_s=5.0, tpot_s=0.2)
SYSTEMS = ("both", "disaggregated", "disaggregated-thread")


@dataclass(frozen=True)
class Config:
    engine: Path
    duration_s: float = 90.0
    streams: int = 6  # steady decodes in flight
    stream_prompt_tokens: int = 64
    stream_output_tokens: int = 128
    long_tokens: int = 1024  # the long prompts mixed in
    long_output_tokens: int = 8
    long_rate: float = 0.15  # long prompts per second (Poisson)
    max_num_seqs: int = 8


@contextlib.contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """Processes started inside inherit `cores` as their CPU affinity (None: unchanged)."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def system(cfg: Config, kind: str) -> Iterator[tuple[Endpoint, dict[str, TritonServer]]]:
    """The gateway's endpoint and the workers of `kind`, started and stopped."""
    params = {"max_num_seqs": str(cfg.max_num_seqs), "max_waiting": "4096"}
    if kind == "disaggregated-thread":
        params["engine_process"] = "false"
    roles: dict[str | None, set[int] | None] = {None: None} if kind == "both" else {"prefill": {0}, "decode": {1}}
    servers: dict[str, TritonServer] = {}
    try:
        for role, cores in roles.items():
            role_params = params if role is None else {**params, "role": role}
            with pinned(cores):
                servers[role or "both"] = TritonServer(
                    ServerConfig.on_free_ports(cfg.engine, engine_params=role_params)
                )
        for server in servers.values():
            server.wait_ready(timeout_s=300)
        urls = {name: f"127.0.0.1:{s.config.grpc_port}" for name, s in servers.items()}
        metrics = {name: f"http://127.0.0.1:{s.config.metrics_port}/metrics" for name, s in servers.items()}
        if kind == "both":
            args = ["--triton-url", urls["both"], "--metrics-url", metrics["both"]]
        else:
            args = ["--prefill-url", urls["prefill"], "--prefill-metrics-url", metrics["prefill"],
                    "--decode-url", urls["decode"], "--decode-metrics-url", metrics["decode"]]  # fmt: skip
        with GatewayProcess([*args, "--model", "llm", "--nice", "10"], "127.0.0.1", free_port()) as gateway:
            gateway.wait_ready(timeout_s=120)
            yield Endpoint("gateway", gateway.url, "llm"), servers
    finally:
        for server in servers.values():
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in servers.values():
            server.stop()


def workload(cfg: Config, tokenizer) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(steady decode requests, long prompts): enough of each for the duration, prompts all different."""
    n_stream = cfg.streams * int(cfg.duration_s / 2 + 10)
    n_long = int(cfg.long_rate * cfg.duration_s * 2 + 10)
    stream = datasets.fixed(tokenizer, n_stream, cfg.stream_prompt_tokens, cfg.stream_output_tokens, seed=1)
    long = datasets.fixed(tokenizer, n_long, cfg.long_tokens, cfg.long_output_tokens, seed=2)
    return stream, long


async def drive(cfg: Config, endpoint: Endpoint, stream: list[BenchRequest], long: list[BenchRequest]
                ) -> tuple[list[RequestRecord], list[RequestRecord], float]:  # fmt: skip
    """Closed-loop streams plus Poisson long prompts for cfg.duration_s; (stream records, long records, seconds)."""
    stream_iter, long_iter = iter(stream), iter(long)
    stream_records: list[RequestRecord] = []
    long_records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        end = start + cfg.duration_s

        async def steady() -> None:
            while time.perf_counter() < end:
                stream_records.append(await send_gateway(session, endpoint, next(stream_iter)))

        async def arrivals() -> None:
            rng, tasks = np.random.default_rng(3), []
            while (now := time.perf_counter()) < end:
                await asyncio.sleep(min(float(rng.exponential(1 / cfg.long_rate)), max(end - now, 0)))
                if time.perf_counter() < end:
                    tasks.append(asyncio.create_task(send_gateway(session, endpoint, next(long_iter))))
            long_records.extend(await asyncio.gather(*tasks))

        await asyncio.gather(*(steady() for _ in range(cfg.streams)), arrivals())
        return stream_records, long_records, time.perf_counter() - start


def measure(cfg: Config, kind: str, stream: list[BenchRequest], long: list[BenchRequest], warm: list[BenchRequest],
            log) -> dict:  # fmt: skip
    busy = cpu_busy_fraction()  # other work on the machine skews every number: recorded with the run
    with system(cfg, kind) as (endpoint, servers):
        log(f"{kind}: up; warming up (machine busy before: {busy})")
        asyncio.run(_warm(endpoint, warm))
        before = {name: prometheus.fetch(_metrics_url(s)) for name, s in servers.items()}
        log(f"{kind}: measuring {cfg.duration_s:.0f} s")
        stream_records, long_records, seconds = asyncio.run(drive(cfg, endpoint, stream, long))
        after = {name: prometheus.fetch(_metrics_url(s)) for name, s in servers.items()}
    records = stream_records + long_records
    result = {
        "system": kind,
        "busy_before": busy,
        "all": summarize(records, seconds, GOODPUT_SLO),
        "streams": summarize(stream_records, seconds, GOODPUT_SLO),
        "long": summarize(long_records, seconds, GOODPUT_SLO),
    }
    itl = result["streams"]["itl_ms"]
    result["streams"]["itl_p99_over_p50"] = round(itl["p99"] / itl["p50"], 2) if itl else None
    if "decode" in after:
        result["transfer"] = transfer_stats(before["decode"], after["decode"])
    return result


async def _warm(endpoint: Endpoint, warm: list[BenchRequest]) -> None:
    async with aiohttp.ClientSession() as session:
        records = await asyncio.gather(*(send_gateway(session, endpoint, r) for r in warm))
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:2]}")


def _metrics_url(server: TritonServer) -> str:
    return f"http://127.0.0.1:{server.config.metrics_port}/metrics"


def transfer_stats(before: dict[str, float], after: dict[str, float]) -> dict:
    """Reads, bytes and seconds over the measured phase, from the decode worker's counters."""

    def delta(name: str) -> float:
        return prometheus.total(after, name) - prometheus.total(before, name)

    reads, nbytes, seconds = (
        delta("trtserve_kv_transfer_seconds_count"),
        delta("trtserve_kv_transfer_bytes_total"),
        (delta("trtserve_kv_transfer_seconds_sum")),
    )
    return {
        "reads": int(reads),
        "failures": int(delta("trtserve_kv_transfer_failures_total")),
        "bytes": int(nbytes),
        "mean_ms": round(1000 * seconds / reads, 3) if reads else None,
        "mean_mb": round(nbytes / reads / 1e6, 3) if reads else None,
        "gb_s": round(nbytes / seconds / 1e9, 3) if seconds else None,
    }


def memory_copy(cfg: Config) -> dict:
    """The ceiling: the same request's KV copied in one process, as the blocks a pull gathers (every layer, K
    and V, block by block, between two pools laid out as the engine's) and as one contiguous copy."""
    config = EngineConfig.load(cfg.engine)
    spec, block = config.model, config.block_size
    blocks = -(-cfg.long_tokens // block)
    pool_blocks = 4 * blocks
    shape = (spec.num_layers, 2, pool_blocks, block, spec.kv_width)
    src, dst = np.ones(shape, np.float32), np.zeros(shape, np.float32)
    ids = np.arange(0, 2 * blocks, 2)  # every other block: no run longer than one block
    nbytes = blocks * block * bytes_per_token(spec, config.dtype, config.kv_cache_dtype)
    gather, flat = [], []
    a, b = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    for _ in range(20):
        t = time.perf_counter()
        dst[:, :, ids + 1] = src[:, :, ids]
        gather.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(b, a)
        flat.append(time.perf_counter() - t)
    return {"bytes": int(nbytes), "blocks": blocks, "gather_ms": round(1000 * float(np.median(gather)), 3),
            "gather_gb_s": round(nbytes / float(np.median(gather)) / 1e9, 3),
            "contiguous_ms": round(1000 * float(np.median(flat)), 3),
            "contiguous_gb_s": round(nbytes / float(np.median(flat)) / 1e9, 3)}  # fmt: skip


def on_paper() -> dict:
    """Llama-3-8B (32 layers, 8 KV heads x 128, bf16) at 4k tokens: its KV bytes, its prefill's FLOPs and time at
    a stated H100 rate, and the KV's transfer time over each link at its stated rate."""
    layers, kv_heads, head_dim, tokens, params = 32, 8, 128, 4096, 8.03e9
    kv_bytes = 2 * layers * kv_heads * head_dim * 2 * tokens
    flops = 2 * params * tokens + 2 * 2 * layers * 4096 * tokens * tokens / 2  # weights + causal attention
    h100_flops = 989e12 * 0.5  # dense bf16 peak, at a 50 % utilisation typical of long prefills
    links = {"NVLink 4 (H100 SXM, ~450 GB/s one way)": 450e9, "InfiniBand NDR 400 Gb/s (one NIC, 50 GB/s)": 50e9,
             "RoCE 100 Gb/s (12.5 GB/s)": 12.5e9, "PCIe 5 x16 host copy (~55 GB/s)": 55e9}  # fmt: skip
    prefill_s = flops / h100_flops
    per_link = {name: {"ms": round(1000 * kv_bytes / rate, 2), "of_prefill": round(kv_bytes / rate / prefill_s, 3)}
                for name, rate in links.items()}  # fmt: skip
    return {"kv_mib": round(kv_bytes / 2**20, 1), "prefill_tflop": round(flops / 1e12, 1),
            "prefill_ms": round(1000 * prefill_s, 1), "links": per_link}  # fmt: skip


@click.command()
@click.option("--engine", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True)
@click.option("--duration", "duration_s", type=float, default=90.0, show_default=True)
@click.option("--streams", type=int, default=6, show_default=True)
@click.option("--long-tokens", type=int, default=1024, show_default=True)
@click.option("--long-rate", type=float, default=0.15, show_default=True)
@click.option("--systems", default="both,disaggregated", show_default=True, help=f"of {', '.join(SYSTEMS)}")
@click.option("--name", default="disaggregation", show_default=True)
def main(
    engine: Path, duration_s: float, streams: int, long_tokens: int, long_rate: float, systems: str, name: str
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        raise click.ClickException("needs 2 cores: one per worker")
    cfg = Config(engine.resolve(), duration_s, streams, long_tokens=long_tokens, long_rate=long_rate)
    tokenizer = load_tokenizer(cfg.engine)
    stream, long = workload(cfg, tokenizer)
    warm = datasets.fixed(tokenizer, 4, 256, 8, seed=9)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    kinds = [k.strip() for k in systems.split(",") if k.strip()]
    if not kinds or set(kinds) - set(SYSTEMS):
        raise click.BadParameter(f"must name some of {', '.join(SYSTEMS)} (got {systems!r})", param_hint="--systems")
    runs = [measure(cfg, kind, stream, long, warm, log) for kind in kinds]
    command = (f"python -m benchmarks.disaggregation --engine {engine} --duration {duration_s:g} --streams {streams} "
               f"--long-tokens {long_tokens} --long-rate {long_rate:g} --systems {','.join(kinds)}")  # fmt: skip
    results = {"config": {**asdict(cfg), "engine": str(cfg.engine)}, "runs": runs, "memory_copy": memory_copy(cfg),
               "on_paper": on_paper(), "command": command}  # fmt: skip
    md, _ = write_report(name, results, render)
    log(f"wrote {md}")
    for run in runs:
        log(f"{run['system']}: streams ITL p50/p99 {run['streams']['itl_ms']}; long TTFT {run['long']['ttft_ms']}")


if __name__ == "__main__":
    main()

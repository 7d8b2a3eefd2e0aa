"""NVIDIA aiperf (its own venv: `bash benchmarks/peers/setup.sh aiperf`) profiling an OpenAI chat
endpoint, the gateway's or vLLM's, with results in this suite's keys.

aiperf is run without HF_HUB_OFFLINE (0.13 then fails to load a tokenizer from a local path) and
reads the tokenizer from the engine or checkpoint directory.
"""

from __future__ import annotations

import json
import resource
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import servers
from benchmarks.cpu import wait_quiet
from benchmarks.suite import Row

AIPERF = servers.VENVS / "aiperf" / "bin" / "aiperf"
VLLM_SYSTEM = "aiperf -> vLLM OpenAI server /v1/chat/completions"


@dataclass(frozen=True)
class Profile:
    """One aiperf profile's workload: synthetic prompts of `prompt_len` tokens (before the chat
    template), exactly `output_len` output tokens, `requests` after 2 warm-up requests."""

    concurrency: int
    requests: int
    prompt_len: int
    output_len: int


def summary(export: dict) -> dict:
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


def run(url: str, model: str, tokenizer_dir: Path, p: Profile, out_dir: Path) -> dict:
    """One aiperf profile of `url`'s /v1/chat/completions; its client CPU seconds included."""
    command = [str(AIPERF), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
               "--tokenizer", str(tokenizer_dir), "--concurrency", str(p.concurrency), "--request-count",
               str(p.requests), "--warmup-request-count", "2", "--prompt-input-tokens-mean", str(p.prompt_len),
               "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(p.output_len),
               "--prompt-output-tokens-stddev", "0", "--extra-inputs", '{"ignore_eos": true, "temperature": 0.0}',
               "--use-server-token-count", "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
               "--random-seed", str(p.concurrency), "--output-artifact-dir", str(out_dir)]  # fmt: skip
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out_dir.with_suffix(".log"), "wb") as log:  # not HF_HUB_OFFLINE: aiperf 0.13 then misreads a path
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    export = out_dir / "profile_export_aiperf.json"
    if proc.returncode != 0 or not export.exists():
        raise RuntimeError(f"aiperf exited {proc.returncode}; log {out_dir.with_suffix('.log')}")
    out = summary(json.loads(export.read_text()))
    out["client_cpu_s"] = round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2)
    return out


def row(workload: str, system: str, url: str, model: str, tokenizer_dir: Path, p: Profile, repetitions: int,
        logs: Path, log: Callable[[str], None], quiet: bool = True) -> Row:  # fmt: skip
    """`repetitions` profiles as one row; a missing aiperf or a failed run becomes the row's reason."""
    out = Row(workload, system, f"concurrency {p.concurrency}", p.concurrency)
    if not AIPERF.exists():
        out.unavailable = "aiperf is not installed: bash benchmarks/peers/setup.sh aiperf"
    for rep in range(repetitions if not out.unavailable else 0):
        if quiet:  # not for vLLM: its CPU worker polls (~60% of a core) even while idle
            wait_quiet(log)
        try:
            out.reps.append(run(url, model, tokenizer_dir, p, logs / f"aiperf-{model}-c{p.concurrency}-rep{rep}"))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out.unavailable = str(exc)
            break
        log(f"{system} | c{p.concurrency} | rep {rep}: {out.reps[-1]}")
    return out


def vllm_rows(workload: str, profiles: list[Profile], repetitions: int, logs: Path,
              log: Callable[[str], None]) -> list[Row]:  # fmt: skip
    """aiperf against vLLM's OpenAI server (prefix caching off), only where its peer venv already exists."""
    if not (servers.VENVS / "vllm" / ".done").exists():
        return [Row(workload, VLLM_SYSTEM, "-", 0, unavailable="benchmarks/.venvs/vllm/.done is absent; installing "
                    "vLLM (bash benchmarks/peers/setup.sh vllm, ~25 min) was left out of this run")]  # fmt: skip
    from builder.sources import resolve_model

    checkpoint = resolve_model("smollm2-135m").checkpoint_dir
    settings = servers.ServingSettings(prefix_caching=False)
    with servers.vllm(checkpoint, settings, logs / "vllm.log") as ep:
        return [row(workload, VLLM_SYSTEM, ep.url, ep.model, checkpoint, p, repetitions, logs, log, False)
                for p in profiles]  # fmt: skip


def version() -> str | None:
    proc = subprocess.run([str(AIPERF), "--version"], capture_output=True, text=True) if AIPERF.exists() else None
    return proc.stdout.strip() if proc else None

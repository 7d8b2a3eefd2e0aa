"""What the reliability benchmark checks of the server once its load is over: the KV cache all free, the gateway
healthy and answering, crashes (Fatal Python errors in every Triton and gateway log seen, our processes' faults in
the kernel log), memory over time, and how the machine's CPU was shared (other work on these cores slows the
server under test)."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

from benchmarks import prometheus
from benchmarks.cpu import machine_busy_s
from benchmarks.reliability_serve import Serve, Watch, fatal_errors, kernel_crashes, read_dmesg

KV_METRICS = {"usage_ratio": "trtserve_kv_cache_usage_ratio", "used_blocks": "trtserve_kv_cache_used_blocks",
              "cached_blocks": "trtserve_kv_cache_cached_blocks", "total_blocks": "trtserve_kv_cache_blocks_total",
              "running": "trtserve_num_requests_running", "waiting": "trtserve_num_requests_waiting"}  # fmt: skip


def kv_after(metrics_url: str, wait_s: float = 30.0) -> dict:
    """The engine's KV and queue gauges once nothing is held (or after `wait_s`: the last scrape)."""
    deadline, values = time.monotonic() + wait_s, {}
    while True:
        try:
            samples = prometheus.fetch(metrics_url)
            values = {key: prometheus.total(samples, name) for key, name in KV_METRICS.items()}
        except (OSError, ValueError) as exc:
            values = {"error": str(exc)}
        if values.get("used_blocks") == 0 or time.monotonic() > deadline:
            return values
        time.sleep(1)


def healthy(serve: Serve, model: str) -> bool:
    """The gateway answers /health with 200 and completes a request."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{serve.openai_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(f"{serve.openai_url}/health", timeout=10) as response:
            if response.status != 200:
                return False
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["choices"][0]["finish_reason"] is not None
    except (OSError, ValueError, KeyError):
        return False


def crashes(serve: Serve, watch: Watch, since: float, log_dir: Path) -> dict:
    """Fatal Python errors in every Triton and gateway log seen (copied to `log_dir`), and our processes'
    segfault/GP-fault lines in the kernel log since `since` (uptime seconds)."""
    logs = sorted(watch.logs | set(serve.logged_paths()))
    for path in logs:
        if path.is_file():
            shutil.copy(path, log_dir / f"{path.parent.name}-{path.name}")
    fatal = fatal_errors(logs)
    dmesg = read_dmesg()
    ours, others = kernel_crashes(dmesg, since, watch.pids) if dmesg is not None else ([], [])
    return {"count": sum(fatal.values()) + len(ours), "fatal_python_errors": fatal, "kernel_ours": ours,
            "kernel_others": others, "dmesg_readable": dmesg is not None}  # fmt: skip


def rss_timeline(watch: Watch, points: int = 200) -> list[list[float]]:
    """(t, tritonserver, stubs, gateway MiB) at up to `points` evenly spaced samples."""
    step = max(1, len(watch.timeline) // points)
    return [[t, *(round(x / 2**20) for x in parts)] for t, *parts in watch.timeline[::step]]


def cpu_use(busy0: float, client0: float, watch: Watch, started: float, quiet_before: float | None) -> dict:
    """Core-seconds over the run: the machine's, trtserve's processes', this client's, and the rest (other work on
    these shared cores, which slows the server under test)."""
    wall, machine = time.monotonic() - started, machine_busy_s() - busy0
    ours, client = watch.cpu_s, time.process_time() - client0
    return {"wall_s": round(wall, 1), "machine_busy_core_s": round(machine), "trtserve_core_s": round(ours),
            "client_core_s": round(client), "other_core_s": round(max(0.0, machine - ours - client)),
            "busy_before": quiet_before}  # fmt: skip

"""The GPU check's plumbing (benchmarks/gpu.py), the host-overhead and overlap benchmarks, run on the CPU at toy sizes:
each part writes its JSON, the engine part fails loudly when a request fails, the host path reports every
batch. What they measure on a GPU is not checked here (no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import host_overhead, overlap

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_each_part(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--out", str(tmp_path), "--dry-run", "--parts",
                           "engine"], capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "environment.json").read_text())["python"]
    run = json.loads((tmp_path / "engine-tiny.run.json").read_text())
    assert run["returncode"] == 0, run["tail"]
    measured = json.loads((tmp_path / "engine-tiny.json").read_text())
    assert measured["trtserve"]["tokens"] == 4 * 8 and measured["single_stream"]["tokens"] == 8
    assert measured["hf_eager"]["out_tok_s"] > 0
    profiled = measured["profiled_batch"]  # on the CPU no kernel runs on a device: a zero busy share
    assert profiled["tokens"] == 4 * 8 and profiled["gpu_busy_share"] == 0.0 and profiled["wall_ms_per_step"] > 0


def test_kv_tier_copy_part_runs_on_the_cpu_in_the_dry_run(tmp_path):
    command = [sys.executable, "-m", "benchmarks.gpu", "--out", str(tmp_path), "--dry-run", "--parts", "kv_tiers"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads((tmp_path / "kv_tier_copy.json").read_text())
    assert measured["device"] == "cpu" and [r["blocks"] for r in measured["rows"]] == [1, 16, 128]
    assert all(r["gather_gb_s"] > 0 and r["scatter_gb_s"] > 0 for r in measured["rows"])
    assert measured["rows"][0]["bytes"] == 30 * 2 * 16 * 192 * 4  # one float32 block of SmolLM2's shape


def test_lora_kernel_part_runs_interpreted_in_the_dry_run(tmp_path):
    from plugins_cuda.interpreter import interpreter_problem

    if problem := interpreter_problem():
        pytest.skip(problem)
    command = [sys.executable, "-m", "benchmarks.gpu", "--out", str(tmp_path), "--dry-run", "--parts", "lora"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((tmp_path / "lora.run.json").read_text())
    assert run["returncode"] == 0, run["tail"]
    measured = json.loads((tmp_path / "lora_kernel.json").read_text())
    assert measured["device"] == "cpu" and measured["timings_meaningful"] is False and measured["slots"] == 8
    rows = measured["rows"]
    assert [(r["rank"], r["batch"]) for r in rows] == [
        (rank, batch) for rank in (16, 64) for batch in ("decode-8", "decode-16", "prefill-2x24")
    ]
    assert [r["segments"] for r in rows[:3]] == [8, 16, 2]  # decode rows one segment each, prefill chunks one each
    assert all(r["error"] < 1e-5 for r in rows)  # float32 against the torch reference: the update really lands
    assert all(r["plain"]["lora_us"] > 0 and r["plain"]["base_us"] > 0 and "graph" not in r for r in rows)


def test_gpu_check_without_cuda_refuses_in_seconds_and_names_the_dry_run(tmp_path):
    """Without CUDA (hidden here, so this holds on a GPU machine too) the command runs no part: before,
    it ran the engine part at full size on the CPU for over ten minutes."""
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)  # fmt: skip
    seconds = time.monotonic() - start
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "GPU (CUDA)" in done.stderr and "--dry-run" in done.stderr, done.stderr
    assert seconds < 10, f"took {seconds:.1f} s"
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def test_host_overhead_times_the_core_step_and_the_text_apart(llama_engine):
    step_s, text_s, backend_s = host_overhead.time_steps(4, 6, llama_engine)
    assert len(step_s) == 6 and len(text_s) == 6 and all(s > 0 for s in step_s + text_s)
    assert all(0 < b < s for b, s in zip(backend_s, step_s, strict=True))  # the null backend's calls, inside the step


def test_host_overhead_times_steps_before_and_after_the_heap_freeze(llama_engine):
    import gc

    rows = host_overhead.gc_pauses(4, 8, llama_engine)
    assert [r["heap"] for r in rows] == ["as start left it", "frozen after start"]
    assert all(r["steps"] == 8 and 0 < r["median_us"] <= r["p99_us"] <= r["max_us"] for r in rows)
    assert gc.get_freeze_count() == 0, "the heap is unfrozen after the measurement"


def test_host_overhead_over_the_torch_backend_without_kernels(llama_engine):
    """The torch backend's host work per step is timed inside the step, no Triton kernel launched."""
    from triton.runtime.interpreter import InterpretedFunction

    launched = []
    original = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *a, **k: launched.append(self.fn.__name__)  # type: ignore[method-assign]
    try:
        step_s, _, backend_s = host_overhead.time_steps(4, 6, llama_engine, "torch")
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]
    assert not launched, f"kernels ran: {set(launched)}"
    assert len(step_s) == 6 and all(0 < b < s for b, s in zip(backend_s, step_s, strict=True))


def test_overlap_benchmark_launches_only_when_overlapping(llama_engine):
    """The simulated device is driven through `launch` (overlapped scheduling) or `step_sample` (serial); the
    busy share is a share (its value on this machine is the benchmark's, not checked)."""
    on = overlap.cadence(4, 1e-4, 8, llama_engine, overlap=True)
    off = overlap.cadence(4, 1e-4, 8, llama_engine, overlap=False)
    assert on["launches"] > 8 and off["launches"] == 0
    assert all(0 < r["busy"] <= 1.0 and r["step_s"] > 0 for r in (on, off))

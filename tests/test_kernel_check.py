"""`python -m plugins_cuda.check`: its CPU mode (--interpret) runs in CI, it fails on a
mismatch, and without a GPU it refuses to run the GPU mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")


def run_check(args: list[str], code: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    script = f"import sys\nimport plugins_cuda.check as check\n{code}\nsys.exit(check.main({args!r}))"
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the check sets it itself
    env = {**base, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)


def test_interpret_mode_checks_every_kernel_on_cpu(tmp_path):
    result = run_check(["--interpret", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    rows = report["correctness"]
    assert report["device"] == "cpu" and report["bench"] == []
    assert {r["kernel"] for r in rows} == {"paged_attention", "fused_rmsnorm_qkv_rope/decode",
                                           "fused_rmsnorm_qkv_rope/prefill", "fused_rmsnorm_qkv_rope/gemm",
                                           "add_rms_norm + silu_mul"}  # fmt: skip
    assert {r["dtype"] for r in rows} == {"float32", "float16"} and all(r["ok"] for r in rows)
    fp32 = [r for r in rows if r["kernel"] == "paged_attention" and r["dtype"] == "float32"]
    assert fp32 and all(r["kv_write"] == 0 and r["plugin"] < 1e-4 and r["ragged"] < 1e-4 for r in fp32)
    assert "| paged_attention | gqa3 split decode | float16 |" in (tmp_path / "check.md").read_text()


def test_a_mismatch_fails_the_check(tmp_path):
    """The comparison can fail: the ragged attention launched with a wrong scale (1, not
    head_dim ** -0.5) is reported, and only it."""
    # imported before check.main sets the interpreter mode: the environment sets it instead
    patch = ("import plugins_cuda.attention_launch as launch\n"
             "real = launch.launch_ragged\n"
             "launch.launch_ragged = lambda *a, **k: real(*a, **{**k, 'scale': 1.0})\n")  # fmt: skip
    result = run_check(["--interpret", "--out", str(tmp_path)], patch, env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "MISMATCH paged_attention" in result.stderr and "MISMATCH fused" not in result.stderr


def test_without_a_gpu_the_gpu_mode_refuses_clearly(tmp_path):
    result = run_check(["--out", str(tmp_path)], env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and "--interpret" in result.stderr
    assert not (tmp_path / "check.json").exists()


def test_interpreter_runs_are_refused_with_the_numpy_that_breaks_them(tmp_path):
    """Triton 3.6 (the GPU image's) with numpy 2.5: a clear refusal, not a TypeError in a kernel."""
    from plugins_cuda.interpreter import interpreter_problem

    assert interpreter_problem("3.6.0", "2.5.2") and "numpy<2.4" in interpreter_problem("3.6.0", "2.4.0")
    assert interpreter_problem("3.6.0", "2.3.5") is None and interpreter_problem("3.9.0", "2.5.2") is None
    assert interpreter_problem("3.7.0+git1234", "2.4.1") is None
    fake = ("import importlib.metadata as m\nreal = m.version\n"
            "m.version = lambda name: {'numpy': '2.5.2', 'triton': '3.6.0'}.get(name) or real(name)\n")  # fmt: skip
    result = run_check(["--interpret", "--out", str(tmp_path)], fake)
    assert result.returncode == 2 and "only 0-dimensional arrays" in result.stderr

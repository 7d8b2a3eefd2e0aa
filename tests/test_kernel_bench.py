"""plugins_cuda/bench.py's bookkeeping without a GPU: the child's pending/row lines, the parent's
resume after a crash (the case and implementation named, the case rerun alone, the rest still
timed), the report's markdown, and the refusal to run without a GPU. The timings themselves
need a CUDA GPU: `python -m plugins_cuda.bench` there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from plugins_cuda import bench, bench_cases


def test_child_marks_each_implementation_before_timing_it(tmp_path, monkeypatch):
    def fake_case(case, timer, mark):
        times = {}
        for name in ("before", "after"):
            mark(name)
            times[name] = timer(lambda: None)
        return {**case, **times}

    monkeypatch.setitem(bench_cases.RUN, "prefill", fake_case)
    monkeypatch.setattr(bench, "_timer", lambda mode: lambda fn: 7.0)
    rows = tmp_path / "rows.jsonl"
    assert bench.child("prefill", "graph", 1, False, False, rows) == 0
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [next(iter(line)) for line in lines] == ["pending", "pending", "row"]
    assert lines[-1]["row"] == {"bench": "prefill", "mode": "graph", "tokens": 8192, "before": 7.0, "after": 7.0}


def test_a_crash_is_recorded_rerun_alone_and_the_sweep_goes_on(monkeypatch):
    cases = [{"batch": b} for b in (1, 8, 32, 128, 256)]
    monkeypatch.setattr(bench_cases, "cases", lambda part, quick=False: cases)
    calls = []
    imx = "RuntimeError: an illegal memory access was encountered"

    def row(c, **extra):
        return {"bench": "decode", "mode": "graph", **c, "after_us": 1.0, **extra}

    def fake_spawn(part, mode, first, only, quick, skip=""):
        calls.append((first, only, skip))
        if only and cases[first]["batch"] == 8:  # case 8 passes alone: it crashed only after case 1
            return [row(cases[first])], None, ""
        if only and not skip:  # case 128 crashes alone too, in `before`
            return [], "before", f"Traceback\n{imx}"
        if only:
            return [row(cases[first], before_us=None)], None, ""
        crash_at = {0: 1, 2: 3}.get(first, len(cases))  # dies at cases 8 and 128 in sequence
        return [row(c) for c in cases[first:crash_at]], ("sdpa" if crash_at < len(cases) else None), imx

    monkeypatch.setattr(bench, "_spawn", fake_spawn)
    rows = bench.run_part("decode", "graph", False)
    assert calls == [(0, False, ""), (1, True, ""), (2, False, ""), (3, True, ""), (3, True, "before"), (4, False, "")]
    assert [r["batch"] for r in rows] == [1, 8, 32, 128, 256]  # every case has a row
    assert rows[1]["crashed_in_sequence"] == "sdpa" and rows[1]["alone"] == "passed" and rows[1]["after_us"] == 1.0
    assert rows[3]["alone"] == "before crashed" and rows[3]["before_us"] is None and rows[3]["after_us"] == 1.0
    assert "illegal memory access" in rows[3]["error"]


def test_the_child_skips_the_implementation_that_crashed(tmp_path, monkeypatch):
    def fake_case(case, timer, mark):
        times = {}
        for name in ("before", "after"):
            mark(name)
            times[f"{name}_us"] = timer(lambda: None)
        return {**case, **times}

    monkeypatch.setitem(bench_cases.RUN, "decode", fake_case)
    monkeypatch.setattr(bench, "_timer", lambda mode: lambda fn: 2.0)
    rows = tmp_path / "rows.jsonl"
    bench.child("decode", "plain", 0, True, False, rows, skip="before")
    assert json.loads(rows.read_text().splitlines()[-1])["row"]["before_us"] is None


def test_markdown_has_a_table_per_part_and_mode():
    report = {"environment": {"gpu": "NVIDIA H200"}, "command": "python -m plugins_cuda.bench",
              "rows": [{"bench": "decode", "mode": "graph", "batch": 1, "after_us": 3.0},
                       {"bench": "decode", "mode": "graph", "batch": 8, "crashed": "sdpa"}]}  # fmt: skip
    text = bench.markdown(report)
    assert "## decode, graph launches" in text and "| batch | after_us | crashed |" in text
    assert "| 8 |  | sdpa |" in text


def test_refuses_without_a_gpu():
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "plugins_cuda.bench"], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr


@pytest.mark.parametrize("part", ["decode", "prefill", "prologue"])
def test_quick_cases_are_a_subset(part):
    assert all(case in bench_cases.cases(part) for case in bench_cases.cases(part, quick=True))


DRY_RUN = """
import json, os
os.environ["TRITON_INTERPRET"] = "1"
from plugins_cuda import bench_cases as b
b.DEVICE, b.DTYPE = "cpu", "float32"
b.HEADS, b.KV_HEADS, b.HEAD_DIM, b.HIDDEN = 4, 2, 32, 64
marks = []
timer = lambda fn: (fn(), 2.0)[1]
rows = [b.decode({"batch": 2, "context": 1100}, timer, marks.append), b.prefill({"tokens": 40}, timer, marks.append),
        b.prologue({"tokens": 65}, timer, marks.append)]
print(json.dumps({"rows": rows, "marks": marks}))
"""


def test_every_case_runs_once_on_cpu_at_small_sizes():
    """The cases' plumbing (before/after launchers, SDPA, the unfused prologue) at toy sizes under
    the interpreter: what would otherwise first run on a GPU, at that machine's cost."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", DRY_RUN], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["marks"] == ["before", "before_ragged", "after", "sdpa", "before", "after", "sdpa", "unfused",
                            "before_decode", "before_prefill", "after", "after_gemm"]  # fmt: skip
    decode, prefill, prologue = out["rows"]
    assert decode["after_vs_sdpa"] == 1.0 and decode["sdpa_backend"]
    assert prefill["after_TFLOP/s"] > 0 and prologue["after_tactic"] == "gemm"

"""plugins_cuda/bench.py's bookkeeping without a GPU: the child's pending/row lines, the parent's
resume after a crash (the case and implementation named, the case rerun alone, the rest still
timed), the report's markdown, and the refusal to run without a GPU. The timings themselves
need a CUDA GPU: `python -m plugins_cuda.bench` there."""

from __future__ import annotations

import json
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
    cases = [{"batch": b} for b in (1, 8, 32, 128)]
    monkeypatch.setattr(bench_cases, "cases", lambda part, quick=False: cases)
    calls = []

    def fake_spawn(part, mode, first, only, quick):
        calls.append((first, only))
        if only:
            return [{"bench": part, "mode": mode, **cases[first], "after_us": 1.0}], None, ""
        if first <= 1:  # dies timing case 1 in sequence, as the decode sweep did
            done = [{"bench": part, "mode": mode, **c, "after_us": 1.0} for c in cases[first:1]]
            return done, "before", "RuntimeError: an illegal memory access was encountered"
        return [{"bench": part, "mode": mode, **c, "after_us": 1.0} for c in cases[first:]], None, ""

    monkeypatch.setattr(bench, "_spawn", fake_spawn)
    rows = bench.run_part("decode", "graph", False)
    assert calls == [(0, False), (1, True), (2, False)]
    crash = rows[1]
    assert crash["batch"] == 8 and crash["crashed"] == "before" and crash["alone"] == "passed"
    assert "illegal memory access" in crash["error"][0]
    assert [r["batch"] for r in rows if "after_us" in r] == [1, 8, 32, 128]  # every case still timed


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

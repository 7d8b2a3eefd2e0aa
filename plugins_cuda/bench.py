"""`python -m plugins_cuda.bench`: the kernels' before/after table on a CUDA GPU, in one run.

Cases and implementations: plugins_cuda/bench_cases.py. Every part (decode, prefill, prologue)
runs twice, timed by plain launches (triton.testing.do_bench: the launcher's Python included
when the GPU outruns it) and by CUDA-graph replays (do_bench_cudagraph: what the torch backend's
decode steps are), each part and mode in a process of its own: one illegal memory access kills
every later CUDA call of its process, so a crash ends only its own process. The child appends a
"pending" line before timing each implementation and the row after each case; when it dies the
parent knows the case and implementation it was timing, reruns that case alone in a fresh
process (did it crash alone, or only after the cases before it?) and, if it crashes alone, once
more without that implementation, so the others still get their numbers; then it resumes at
the next case.
The report (card, driver, CUDA, torch, Triton, numpy) is rewritten after every part:
--out/<name>.json and .md. Without a GPU it exits 2; nothing here was timed on this repo's CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = ("decode", "prefill", "prologue")
MODES = ("plain", "graph")
CHILD_TIMEOUT_S = 900


def _timer(mode: str):
    import triton.testing

    if mode == "graph":
        return lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100)
    return lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100)


def child(part: str, mode: str, first: int, only: bool, quick: bool, rows_path: Path, skip: str = "") -> int:
    """Run cases[first:] (or just cases[first]) of `part`, appending JSON lines to rows_path;
    the implementation named `skip` is not run (its time is null)."""
    from plugins_cuda import bench_cases

    todo = bench_cases.cases(part, quick)
    todo = todo[first : first + 1] if only else todo[first:]
    timer, current = _timer(mode), [""]

    def timed(fn) -> float:
        return math.nan if current[0] == skip else timer(fn)

    with rows_path.open("a") as out:
        for case in todo:

            def mark(impl: str, case=case) -> None:
                current[0] = impl
                out.write(json.dumps({"pending": impl, "case": case}) + "\n")
                out.flush()

            row = bench_cases.RUN[part](case, timed, mark)
            row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
            out.write(json.dumps({"row": {"bench": part, "mode": mode, **row}}) + "\n")
            out.flush()
    return 0


def environment() -> dict:
    """Card and software versions, read in a child process (the parent never touches CUDA)."""
    code = (
        "import json, platform, numpy, torch, triton\n"
        "p = torch.cuda.get_device_properties(0)\n"
        "print(json.dumps({'gpu': p.name, 'sms': p.multi_processor_count, 'capability': '%d.%d' % (p.major, p.minor),"
        " 'memory_gib': round(p.total_memory / 2**30, 1),"
        " 'driver': getattr(torch._C, '_cuda_getDriverVersion', lambda: None)(),"
        " 'cuda': torch.version.cuda, 'torch': torch.__version__, 'triton': triton.__version__,"
        " 'numpy': numpy.__version__, 'python': platform.python_version()}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if result.returncode:
        return {"error": result.stderr[-500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _spawn(part: str, mode: str, first: int, only: bool, quick: bool,
           skip: str = "") -> tuple[list[dict], str | None, str]:  # fmt: skip
    """(rows, implementation being timed when the child died or None, stderr tail)."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as rows_file:
        cmd = [sys.executable, "-m", "plugins_cuda.bench", "--child", part, "--mode", mode, "--first", str(first),
               "--rows", rows_file.name, "--skip", skip, *(["--only"] if only else []),
               *(["--quick"] if quick else [])]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            code, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as timeout:
            code, err = -9, f"timed out after {CHILD_TIMEOUT_S} s: {timeout.stderr or ''}"
        lines = [json.loads(line) for line in Path(rows_file.name).read_text().splitlines() if line.strip()]
    rows = [line["row"] for line in lines if "row" in line]
    pending = lines[-1]["pending"] if lines and "pending" in lines[-1] else None
    crashed = pending or ("?" if code else None)
    return rows, crashed, (err or "")[-1500:] if code else ""


def run_part(part: str, mode: str, quick: bool) -> list[dict]:
    """Every case of `part` in `mode`. When a case crashes its process it is rerun alone: if it
    passes, its row notes the crash in sequence; if it crashes alone too, it is rerun once more
    without the implementation that crashed, whose time is null and which the row names."""
    from plugins_cuda import bench_cases

    todo, rows, first = bench_cases.cases(part, quick), [], 0
    while first < len(todo):
        done, crashed, err = _spawn(part, mode, first, False, quick)
        rows += done
        first += len(done)
        if crashed is None:
            break
        if first >= len(todo):  # died after its last case (at exit)
            rows.append({"bench": part, "mode": mode, "crashed": "after the last case", "error": _last_line(err)})
            break
        in_sequence = {"crashed_in_sequence": crashed, "error": _last_line(err)}
        alone, crashed_alone, err_alone = _spawn(part, mode, first, True, quick)
        if crashed_alone is None:
            rows += [{**row, **in_sequence, "alone": "passed"} for row in alone]
        else:
            rest, _, _ = _spawn(part, mode, first, True, quick, skip=crashed_alone)
            crash = {**in_sequence, "alone": f"{crashed_alone} crashed", "error": _last_line(err_alone)}
            rows += [{**row, **crash} for row in rest] or [{"bench": part, "mode": mode, **todo[first], **crash}]
        first += 1
    return rows


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Kernel benchmark: {env.get('gpu', '?')}", "", "```", json.dumps(env), "```", "",
             f"Command: `{report['command']}`", ""]  # fmt: skip
    for part in PARTS:
        for mode in MODES:
            group = [r for r in report["rows"] if r["bench"] == part and r["mode"] == mode]
            if not group:
                continue
            keys = list(dict.fromkeys(k for r in group for k in r if k not in ("bench", "mode")))
            lines += [f"## {part}, {mode} launches", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in group]
            lines.append("")
    return "\n".join(lines)


def run_all(out: Path | None = None, name: str | None = None, parts=PARTS, modes=MODES, quick=False,
            env: dict | None = None) -> list[dict]:  # fmt: skip
    """Every part x mode, each in its own processes; writes the report after each."""
    env = env or environment()
    name = name or "kernels-" + env.get("gpu", "gpu").lower().replace("nvidia ", "").replace(" ", "-")
    out = out or Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": env, "command": " ".join(["python -m plugins_cuda.bench", *sys.argv[1:]]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "rows": []}  # fmt: skip
    for part in parts:
        for mode in modes:
            report["rows"] += run_part(part, mode, quick)
            (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
            (out / f"{name}.md").write_text(markdown(report))
            print(f"{part}/{mode}: {len(report['rows'])} rows so far -> {out / name}.json", flush=True)
    return report["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins_cuda.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: decode,prefill,prologue")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: plain,graph")
    parser.add_argument("--quick", action="store_true", help="three cases a part (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="directory (default benchmarks/results)")
    parser.add_argument("--name", default=None, help="report name (default kernels-<gpu>)")
    parser.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.mode, args.first, args.only, args.quick, args.rows, args.skip)
    env = {} if os.environ.get("TRITON_INTERPRET") == "1" else environment()
    if not env or "error" in env:
        print(f"plugins_cuda.bench needs a CUDA GPU and TRITON_INTERPRET unset ({env.get('error', '')!s:.300})",
              file=sys.stderr)  # fmt: skip
        return 2
    run_all(args.out, args.name, args.parts.split(","), args.modes.split(","), args.quick, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())

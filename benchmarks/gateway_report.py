"""The gateway benchmark's analysis and report: gateway vs direct Triton paired by repetition, against
issue 14's targets, and the markdown of results/gateway.md (benchmarks/gateway.py measures)."""

from __future__ import annotations

import statistics

from benchmarks import tables
from benchmarks.suite import DEFAULT_SLO

GATEWAY = "gateway /v1/completions (SSE) -> Triton gRPC"
TRITON = "Triton generate_stream (SSE, direct)"
TTFT_TARGET_MS, THROUGHPUT_TARGET = 10.0, 0.95  # issue 14, at the highest level
QUIET_CPU_S = 2.0  # a pair counts as undisturbed when other processes used at most this in each phase


def overhead(rows: list[dict], max_other_cpu_s: float | None = None) -> list[dict]:
    """Gateway vs direct Triton per mode (probe, each level), paired by repetition (they ran back to back).
    max_other_cpu_s: keep only pairs in which other processes used at most this much CPU in either phase."""
    pairs: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["system"] in (GATEWAY, TRITON) and r["reps"]:
            pairs.setdefault(r["mode"], {})[r["system"]] = r
    out = []
    for mode, pick in pairs.items():
        if len(pick) < 2:
            continue
        reps = [
            (g, t)
            for g, t in zip(pick[GATEWAY]["reps"], pick[TRITON]["reps"], strict=False)
            if max_other_cpu_s is None or max(g.get("other_cpu_s", 0), t.get("other_cpu_s", 0)) <= max_other_cpu_s
        ]
        if not reps:
            continue
        values = {
            "throughput_ratio": [g["output_tok_s"] / t["output_tok_s"] for g, t in reps],
            "ttft_p50_delta_ms": [g["ttft_ms_p50"] - t["ttft_ms_p50"] for g, t in reps],
            "ttft_p99_delta_ms": [g["ttft_ms_p99"] - t["ttft_ms_p99"] for g, t in reps],
            "itl_p50_delta_ms": [g["itl_ms_p50"] - t["itl_ms_p50"] for g, t in reps],
            "ttft_added_ms": [
                g["ttft_beyond_engine_ms"] - t["ttft_beyond_engine_ms"]
                for g, t in reps
                if g.get("ttft_beyond_engine_ms") is not None and t.get("ttft_beyond_engine_ms") is not None
            ],
            "gateway_cpu_ms_per_token": [1000 * g["gateway_cpu_s"] / max(g["output_tokens"], 1) for g, _ in reps],
            "gateway_sys_share": [
                g["gateway_sys_s"] / max(g["gateway_cpu_s"], 0.01) for g, _ in reps if "gateway_sys_s" in g
            ],
            "gateway_major_faults": [g["gateway_major_faults"] for g, _ in reps if "gateway_major_faults" in g],
            "other_cpu_s": [max(g.get("other_cpu_s", 0), t.get("other_cpu_s", 0)) for g, t in reps],
        }
        entry: dict = {"mode": mode, "pairs": len(reps)}
        for name, v in values.items():
            if v:  # ttft_added_ms: only pairs with both engine scrapes comparable
                entry[name] = [round(statistics.median(v), 4), round(min(v), 4), round(max(v), 4)]
        out.append(entry)
    return out


def verdict(entry: dict) -> str:
    ratio, ttft = entry.get("throughput_ratio"), entry.get("ttft_p50_delta_ms")
    if not ratio or not ttft:
        return "not measured"
    ok_tp, ok_ttft = ratio[0] >= THROUGHPUT_TARGET, ttft[0] < TTFT_TARGET_MS
    out = (f"throughput {'met' if ok_tp else 'MISSED'} (≥ {THROUGHPUT_TARGET:g}), TTFT p50 "
           f"{'met' if ok_ttft else 'MISSED'} (< {TTFT_TARGET_MS:g} ms)")  # fmt: skip
    added = entry.get("ttft_added_ms")
    return out + (f", TTFT added beyond the engine {'met' if added[0] < TTFT_TARGET_MS else 'MISSED'}" if added else "")


def overhead_table(entries: list[dict]) -> list[str]:
    cell = lambda v, d=3: "-" if not v else f"{v[0]:.{d}f} ({v[1]:.{d}f}–{v[2]:.{d}f})"  # noqa: E731
    lines = ["| mode | pairs | throughput ratio | TTFT p50 Δ ms | TTFT p99 Δ ms | TTFT added beyond the engine, Δ ms "
             "| ITL p50 Δ ms | gateway CPU ms/token | its system-time share, major faults | other work, CPU s "
             "| targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in entries:
        lines.append(f"| {e['mode']} | {e['pairs']} | {cell(e.get('throughput_ratio'))} | "
                     f"{cell(e.get('ttft_p50_delta_ms'), 1)} | {cell(e.get('ttft_p99_delta_ms'), 1)} | "
                     f"{cell(e.get('ttft_added_ms'), 1)} | "
                     f"{cell(e.get('itl_p50_delta_ms'), 2)} | {cell(e.get('gateway_cpu_ms_per_token'), 2)} | "
                     f"{cell(e.get('gateway_sys_share'), 2)}, {cell(e.get('gateway_major_faults'), 0)} | "
                     f"{cell(e.get('other_cpu_s'), 1)} | {verdict(e)} |")  # fmt: skip
    return lines


def render(payload: dict) -> str:
    m = payload["machine"]
    lines = ["# Gateway overhead (issue 14)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; run {payload['date_utc']}, "
             f"{payload['wall_s']:.0f} s wall. Command: `{payload['command']}`",
             f"CPU busy in the 3 s before the run: {payload['cpu_busy_before']}.", "",
             "Controls: " + "; ".join(payload["controls"]), "",
             "## Overhead: gateway vs direct Triton, paired by repetition", "",
             "Median (min–max) over repetitions of the per-repetition ratio or difference (gateway − Triton). "
             "TTFT added beyond the engine: (client mean TTFT − engine mean TTFT) through the gateway minus the "
             "same through Triton directly, each within its phase, so the engine's queueing cancels. "
             "Gateway CPU: its process's user + system time per output token; a high system-time share with "
             "major faults means the machine was short of memory (library pages re-read: not the gateway's work). "
             "Other work: CPU seconds other processes used during the pair's busier phase (helpers share the "
             f"machine; waits for quiet before repetitions: {payload['quiet_waits_s']} s).", "",
             *overhead_table(payload["overhead"]), "", f"Only pairs with <= {QUIET_CPU_S} CPU s of other work:", "",
             *overhead_table(payload["overhead_quiet"])]  # fmt: skip
    by_workload: dict[str, list[dict]] = {}
    for row in payload["rows"]:
        by_workload.setdefault(row["workload"], []).append(row)
    slo = {"ttft_s": DEFAULT_SLO.ttft_s, "tpot_s": DEFAULT_SLO.tpot_s}
    for workload, rows in by_workload.items():
        lines += ["", f"## {workload}", "", *tables.workload_table(rows, slo)]
    versions = ", ".join(f"{k} {v}" for k, v in payload["versions"].items() if v)
    return "\n".join([*lines, "", "## Versions", "", versions, ""])

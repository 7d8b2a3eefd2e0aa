"""Markdown report of a suite run: controls, one table per workload, equivalence, peers' status."""

from __future__ import annotations


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _cell(row: dict, key: str, digits: int = 0) -> str:
    med = row.get("median", {}).get(key)
    if med is None:
        return "-"
    lo, hi = row["spread"][key]
    if len(row["reps"]) > 1 and hi > lo:
        return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"
    return f"{med:.{digits}f}"


def _triple(row: dict, prefix: str, digits: int = 0) -> str:
    m = row.get("median", {})
    return " / ".join(_fmt(m.get(f"{prefix}_{q}"), digits) for q in ("p50", "p90", "p99"))


def workload_table(rows: list[dict], slo: dict) -> list[str]:
    lines = [
        f"| system | mode | output tok/s | req/s | goodput req/s (TTFT ≤ {slo['ttft_s']} s, TPOT ≤ "
        f"{slo['tpot_s'] * 1000:.0f} ms) | TTFT p50/p90/p99 ms | TPOT p50 ms | ITL p50/p90/p99 ms | "
        "E2E p50/p90/p99 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["unavailable"]:
            lines.append(f"| {r['system']} | {r['mode']} | not run: {r['unavailable'][:300]} |||||||| ")
            continue
        lines.append(
            f"| {r['system']} | {r['mode']} | {_cell(r, 'output_tok_s', 1)} | {_cell(r, 'request_s', 2)} | "
            f"{_cell(r, 'goodput_req_s', 2)} | {_triple(r, 'ttft_ms')} | {_fmt(r['median'].get('tpot_ms_p50'), 1)} | "
            f"{_triple(r, 'itl_ms', 1)} | {_triple(r, 'e2e_ms')} | {_fmt(r['median'].get('failed'))} |"
        )
    return lines


def _find(rows: list[dict], system: str, mode: str, workload: str = "fixed") -> dict | None:
    for r in rows:
        if r["workload"].startswith(workload) and r["system"].startswith(system) and r["mode"] == mode:
            return r.get("median") or None
    return None


def targets(rows: list[dict]) -> list[str]:
    """Issue 7's targets, each as measured ratio (> 1 means trtserve is ahead), or why it is missing."""
    ours = "trtserve via Triton (fp32, prefix caching on)"
    checks = []

    def ratio(label: str, a: dict | None, b: dict | None, key: str, higher_better: bool, goal: float = 1.0) -> None:
        if not a or not b or not a.get(key) or not b.get(key):
            checks.append(f"| {label} | - | - | not measured |")
            return
        r = a[key] / b[key] if higher_better else b[key] / a[key]
        checks.append(f"| {label} | {a[key]:.1f} vs {b[key]:.1f} | {r:.2f}x | {'met' if r >= goal else 'missed'} "
                      f"(goal {goal:g}x) |")  # fmt: skip

    hf_seq = _find(rows, "HF", "single stream")
    ratio("c16 output tok/s vs HF sequential", _find(rows, ours, "concurrency 16"), hf_seq, "output_tok_s", True, 15)
    for c in (8, 16, 32):
        mode = f"concurrency {c}"
        ratio(f"c{c} output tok/s vs vLLM", _find(rows, ours, mode), _find(rows, "vllm", mode), "output_tok_s", True)
    ratio("c1 TTFT p50 ms vs vLLM", _find(rows, ours, "concurrency 1"), _find(rows, "vllm", "concurrency 1"),
          "ttft_ms_p50", False)  # fmt: skip
    ratio("single-stream tok/s vs ORT-GenAI fp32", _find(rows, ours, "concurrency 1"),
          _find(rows, "onnxruntime-genai (fp32)", "single stream"), "output_tok_s", True)  # fmt: skip
    ratio("single-stream tok/s (fp32 engine) vs llama.cpp Q4_1", _find(rows, ours, "concurrency 1"),
          _find(rows, "llama.cpp", "single stream"), "output_tok_s", True)  # fmt: skip
    int4 = next((r["system"] for r in rows if r["system"].startswith("trtserve via Triton (int4")), "-")
    ratio("single-stream tok/s (INT4 engine) vs llama.cpp Q4_1", _find(rows, int4, "concurrency 1"),
          _find(rows, "llama.cpp", "single stream"), "output_tok_s", True)  # fmt: skip
    ratio("single-stream tok/s (INT4 engine) vs ORT-GenAI int4", _find(rows, int4, "concurrency 1"),
          _find(rows, "onnxruntime-genai (int4)", "single stream"), "output_tok_s", True)  # fmt: skip
    ratio("single-stream TPOT p50 ms vs ORT-GenAI fp32", _find(rows, ours, "concurrency 1"),
          _find(rows, "onnxruntime-genai (fp32)", "single stream"), "tpot_ms_p50", False)  # fmt: skip
    ratio("single-stream TPOT p50 ms vs llama.cpp Q4_1", _find(rows, ours, "concurrency 1"),
          _find(rows, "llama.cpp", "single stream"), "tpot_ms_p50", False)  # fmt: skip
    on = next((r.get("median") for r in rows if r["workload"].startswith("shared") and "caching on" in r["system"]
               and r["system"].startswith("trtserve")), None)  # fmt: skip
    off = next((r.get("median") for r in rows if r["workload"].startswith("shared") and "caching off" in r["system"]),
               None)  # fmt: skip
    ratio("prefix caching: TTFT p50 ms on vs off", on, off, "ttft_ms_p50", False, 4)
    return ["| target | trtserve vs other | ratio | status |", "|---|---|---|---|", *checks]


def _quiet_line(payload: dict) -> str:
    busy, load = payload.get("cpu_busy_before"), payload.get("load_avg_1min_before", "-")
    if busy is None:  # runs before cpu_busy_before was recorded
        return f"1-minute load average before the run: {load} (it also counts work that ended minutes before)."
    line = f"CPU busy in the 3 s before the run: {busy:.0%} (1-minute load average {load})"
    if busy > 0.25:
        line += (" (**other work was running: with 2 threads per engine on 2 cores, contention inflates every "
                 "number; rerun on a quiet machine**)")  # fmt: skip
    return line + "."


def render(payload: dict) -> str:
    cfg, m, v = payload["config"], payload["machine"], payload["versions"]
    lines = [
        "# trtserve benchmark",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; run {payload['date_utc']}, "
        f"{payload['wall_s']:.0f} s wall.",
        f"Command: `{payload['command']}`",
        _quiet_line(payload),
        "",
        "Controls: " + "; ".join(payload["controls"]),
        "",
        "Cells are medians of the repetitions with (min–max) across them; percentiles are over "
        "every measured request of a repetition, then the median of those across repetitions.",
        "",
    ]
    by_workload: dict[str, list[dict]] = {}
    for row in payload["rows"]:
        by_workload.setdefault(row["workload"], []).append(row)
    for workload, rows in by_workload.items():
        lines += [f"## {workload}", "", *workload_table(rows, cfg["slo"]), ""]
    lines += ["## Targets (issue 7)", "", "Single-stream rows compare trtserve at concurrency 1 through Triton "
              "(HTTP included) with the in-process peers.", "",
              *targets(payload["rows"]), ""]  # fmt: skip
    eq = payload.get("equivalence")
    if eq:
        lines += ["## Greedy output equivalence (trtserve vs HF eager, token by token)", "",
                  f"{eq['identical']}/{eq['prompts']} prompts identical over {cfg['equivalence_tokens']} tokens"
                  + (f"; served text identical for {eq['served_identical']}/{eq['prompts']}"
                     if eq.get("served_identical") is not None else "") + ".", ""]  # fmt: skip
        for i, r in enumerate(eq["rows"]):
            if not r["identical"]:
                at, margin = r["first_divergence"], r["hf_top2_margin_there"]
                lines.append(f"- prompt {i} ({r['prompt_tokens']} tokens): first divergence at token {at}, "
                             f"HF top-2 logit margin there {margin}")  # fmt: skip
        lines.append("")
    v = {**v, **payload.get("client_versions", {})}
    lines += ["## Versions", "", ", ".join(f"{k} {val}" for k, val in v.items() if val), ""]
    for name, info in payload.get("peer_info", {}).items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {str(val)[:200]}" for k, val in info.items()))
    return "\n".join(lines) + "\n"

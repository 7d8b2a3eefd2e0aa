"""The speculative-decoding benchmark's analysis (issue 18): acceptance from /metrics deltas, medians and
speedups paired by repetition, the targets, markdown and plot (benchmarks/spec_decode.py measures)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks import plots, prometheus, tables

# "draft": `--speculative draft` as served (prompt lookup first, the draft model where it has nothing);
# "draft-model": the draft model for every guess (draft_prompt_lookup_min 0).
OFF, NGRAM, DRAFT, DRAFT_MODEL = "off", "ngram", "draft", "draft-model"
SYSTEMS = (OFF, NGRAM, DRAFT, DRAFT_MODEL)
DRAFT_SYSTEMS = (DRAFT, DRAFT_MODEL)  # served with --draft-engine
COPY, CHAT = "copy-heavy", "chat"
WORKLOADS = (COPY, CHAT)
# Issue 18's targets: single-stream decode tok/s vs off, and no regression beyond noise at the top level.
NGRAM_COPY_TARGET, DRAFT_CHAT_TARGET = 2.0, 1.3
NOISE_FLOOR = 0.05  # the least relative spread counted as noise (the off rows' own spread when larger)
KEYS = ("output_tok_s", "decode_tok_s", "tpot_ms_p50", "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50", "acceptance_rate",
        "mean_acceptance_length", "spec_token_share", "failed")  # fmt: skip
SPEC = "trtserve_spec_decode"


def spec_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    """Speculation over a phase, from two scrapes of one server's /metrics: verify passes (drafts), draft
    tokens, accepted tokens (per draft position too), the acceptance rate and mean acceptance length
    (None without drafts: off, or paused by the batch-size rule), and the share of the generated tokens
    that verify passes emitted (each emits its accepted drafts + 1)."""

    def delta(name: str, *labels: str) -> float:
        return prometheus.total(after, name, *labels) - prometheus.total(before, name, *labels)

    drafts, drafted = delta(f"{SPEC}_drafts_total"), delta(f"{SPEC}_draft_tokens_total")
    accepted, generated = delta(f"{SPEC}_accepted_tokens_total"), delta("trtserve_generation_tokens_total")
    name = f"{SPEC}_accepted_tokens_per_position_total"
    seen = {int(m.group(1)) for k in after if k.startswith(name) and (m := re.search(r'position="(\d+)"', k))}
    per_position = [delta(name, f'position="{i}"') for i in range(max(seen) + 1)] if seen else []
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "accepted_per_position": per_position,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "spec_token_share": round((drafts + accepted) / generated, 4) if generated else None,
    }


def _stats(values: Sequence[float | None], digits: int = 4) -> list[float] | None:
    """[median, min, max] of the values present, rounded alike (so min <= median <= max holds)."""
    kept = [v for v in values if v is not None]
    return [round(x, digits) for x in (statistics.median(kept), min(kept), max(kept))] if kept else None


def aggregate(rows: list[dict]) -> list[dict]:
    """Each row ({workload, system, concurrency, reps}) with median / spread of KEYS over its repetitions,
    its speedups over the off row of the same workload and level, paired by repetition (they ran back to
    back), and its acceptance per draft position pooled over the repetitions."""
    off = {(r["workload"], r["concurrency"]): r for r in rows if r["system"] == OFF}
    out = []
    for row in rows:
        reps = row["reps"]
        entry = {**row, "median": {}, "spread": {}}
        for key in KEYS:
            if (s := _stats([rep.get(key) for rep in reps])) is not None:
                entry["median"][key], entry["spread"][key] = s[0], [s[1], s[2]]
        base = off.get((row["workload"], row["concurrency"]))
        if base is not None and row["system"] != OFF:
            for key, name in (("output_tok_s", "speedup"), ("decode_tok_s", "decode_speedup")):
                ratios = [a[key] / b[key] for a, b in zip(reps, base["reps"], strict=False)
                          if a.get(key) and b.get(key)]  # fmt: skip
                if (s := _stats(ratios, 3)) is not None:
                    entry[name] = s
        drafts = sum(rep.get("drafts") or 0 for rep in reps)
        positions = [rep.get("accepted_per_position") or [] for rep in reps]
        pooled = [sum(p[i] for p in positions if i < len(p)) for i in range(max(map(len, positions), default=0))]
        entry["position_acceptance"] = [round(n / drafts, 3) for n in pooled] if drafts else []
        out.append(entry)
    return out


def _find(rows: list[dict], workload: str, system: str, c: int) -> dict | None:
    return next((r for r in rows if (r["workload"], r["system"], r["concurrency"]) == (workload, system, c)), None)


def _ratio_target(label: str, row: dict | None, key: str, goal: float) -> dict:
    if row is None or not row.get(key):
        return {"target": label, "measured": "-", "status": "not measured"}
    med, lo, hi = row[key]
    return {"target": label, "measured": f"{med:.2f}x ({lo:.2f}–{hi:.2f} over the repetitions)",
            "status": "met" if med >= goal else "missed"}  # fmt: skip


def targets(rows: list[dict], top_level: int) -> list[dict]:
    """Issue 18's targets from aggregated rows: target, measured, status. No regression is judged at
    `top_level`, the run's highest concurrency (the issue's 16), where the batch-size rule pauses drafts."""
    out = [
        _ratio_target(f"ngram ≥ {NGRAM_COPY_TARGET:g}x single-stream decode tok/s, copy-heavy",
                      _find(rows, COPY, NGRAM, 1), "decode_speedup", NGRAM_COPY_TARGET),
        *(_ratio_target(f"{system} ≥ {DRAFT_CHAT_TARGET:g}x single-stream decode tok/s, chat",
                        _find(rows, CHAT, system, 1), "decode_speedup", DRAFT_CHAT_TARGET) for system in DRAFT_SYSTEMS),
    ]  # fmt: skip
    for workload in WORKLOADS:
        base = _find(rows, workload, OFF, top_level)
        for system in SYSTEMS[1:]:
            label = f"no regression beyond noise at c={top_level}, {system}, {workload}"
            row = _find(rows, workload, system, top_level)
            if top_level < 2 or base is None or row is None or not row.get("speedup") or not base["spread"]:
                out.append({"target": label, "measured": "-", "status": "not measured"})
                continue
            lo, hi = base["spread"]["output_tok_s"]
            noise = max(NOISE_FLOOR, (hi - lo) / base["median"]["output_tok_s"])
            med = row["speedup"][0]
            out.append({"target": label, "measured": f"{med:.2f}x output tok/s (noise ±{noise:.0%})",
                        "status": "met" if med >= 1 - noise else "missed"})  # fmt: skip
    return out


def _cell(row: dict, key: str, digits: int) -> str:
    med = row["median"].get(key)
    if med is None:
        return "-"
    lo, hi = row["spread"][key]
    spread = f" ({lo:.{digits}f}–{hi:.{digits}f})" if len(row["reps"]) > 1 and hi > lo else ""
    return f"{med:.{digits}f}{spread}"


def _speedup(row: dict) -> str:
    if row["system"] == OFF:
        return "1 (reference)"
    if not row.get("speedup"):
        return "-"
    med, lo, hi = row["speedup"]
    return f"{med:.2f}x ({lo:.2f}–{hi:.2f})" if hi > lo else f"{med:.2f}x"


def workload_table(rows: list[dict]) -> list[str]:
    lines = ["| system | c | output tok/s | speedup vs off | TPOT p50 ms | ITL p50 / p99 ms | TTFT p50 ms | "
             "acceptance rate | mean acceptance length | tokens via verify | acceptance by draft position | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["concurrency"], SYSTEMS.index(r["system"]))):
        if r.get("unavailable"):
            lines.append(f"| {r['system']} | {r['concurrency']} | not run: {r['unavailable'][:300]} ||||||||||")
            continue
        by_position = " / ".join(f"{x:.2f}" for x in r["position_acceptance"]) or "-"
        lines.append(
            f"| {r['system']} | {r['concurrency']} | {_cell(r, 'output_tok_s', 1)} | {_speedup(r)} | "
            f"{_cell(r, 'tpot_ms_p50', 1)} | {_cell(r, 'itl_ms_p50', 1)} / {_cell(r, 'itl_ms_p99', 0)} | "
            f"{_cell(r, 'ttft_ms_p50', 0)} | {_cell(r, 'acceptance_rate', 2)} | "
            f"{_cell(r, 'mean_acceptance_length', 2)} | {_cell(r, 'spec_token_share', 2)} | {by_position} | "
            f"{_cell(r, 'failed', 0)} |"
        )
    return lines


def render(p: dict) -> str:
    m = p["machine"]
    lines = ["# Speculative decoding (issue 18)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; run {p['date_utc']}, {p['wall_s']:.0f} s "
             f"wall (estimated {p['estimate_s']:.0f} s). Command: `{p['command']}`",
             tables._quiet_line(p), "", "Controls: " + "; ".join(p["controls"]), "",
             "Cells: median of the repetitions (min–max across them); speedups are paired by repetition (each "
             "system's run against the off run of the same repetition, back to back). Acceptance: accepted / "
             "proposed draft tokens; mean acceptance length: tokens per verify pass (accepted + 1); tokens via "
             "verify: share of the generated tokens that verify passes emitted (0 while the batch-size rule "
             "pauses speculation); by draft position: accepted at position i / verify passes.", "",
             "## Targets", "", "| target | measured | status |", "|---|---|---|",
             *[f"| {t['target']} | {t['measured']} | {t['status']} |" for t in p["targets"]]]  # fmt: skip
    for workload in WORKLOADS:
        rows = [r for r in p["rows"] if r["workload"] == workload]
        if rows:
            lines += ["", f"## {p['workload_names'][workload]}", "", *workload_table(rows)]
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
    return "\n".join([*lines, "", "## Versions", "", versions, ""])


def write_plot(p: dict, path: Path) -> None:
    """Output tok/s speedup vs off per level, one panel per workload."""
    panels: dict[str, dict[str, list[tuple[int, float, float, float]]]] = {}
    for r in p["rows"]:
        if r.get("speedup"):
            series = panels.setdefault(r["workload"], {}).setdefault(r["system"], [])
            series.append((r["concurrency"], *r["speedup"]))
    plots.speedup_bars(panels, "output tok/s vs speculation off", path)

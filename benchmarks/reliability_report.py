"""The reliability benchmark's numbers and markdown: outcome counts, refusals by reason, lost requests (listed
one by one, with when and what they got), latency, memory, restarts, crashes, per-kill recovery, targets.

Pure functions of the client's records and what was observed of the server, so tests run them without one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from benchmarks.metrics import percentiles
from benchmarks.reliability_client import CANCELLED, COMPLETED, CUT, FAILED, LOST, OUTCOMES, REFUSED, Result
from benchmarks.reliability_tenants import render as render_tenants

# Seconds from a chaos kill to the first completed request (issue 52): a killed stub and a killed tritonserver have
# their own; a hung stub (SIGSTOP) is to be replaced within serve's --stall-timeout.
RECOVERY_TARGETS_S = {"stub": 10.0, "tritonserver": 30.0, "gateway": 30.0, "hang": 60.0}
PROBLEMS_LISTED = 40  # lost requests written into the report one by one (all are in the run's requests.jsonl)


def summary(results: Sequence[Result]) -> dict:
    """Counts by outcome (and by kind), lost requests, refusals by reason, client retries, TTFT and E2E."""
    outcomes = Counter(r.outcome for r in results)
    streams = [r for r in results if r.stream and r.first_delta is not None]
    done = [r for r in results if r.outcome == COMPLETED]
    problems = sorted((r for r in results if r.outcome in LOST), key=lambda r: r.start)
    return {
        "requests": len(results),
        "outcomes": {o: outcomes.get(o, 0) for o in OUTCOMES},
        "lost": sum(outcomes.get(o, 0) for o in LOST),
        "lost_nothing_produced": outcomes.get(FAILED, 0),
        "cut_with_error_event": sum(r.outcome == CUT and r.error_event for r in results),
        "client_timeouts": sum(r.outcome in LOST and "timeout" in (r.reason or "").lower() for r in results),
        "refusals": refusals(results),
        "client_retried": sum(r.attempts > 1 for r in results),
        "client_retried_completed": sum(r.attempts > 1 and r.outcome == COMPLETED for r in results),
        "by_kind": by_kind(results),
        "ttft_ms": percentiles([r.first_delta - r.start for r in streams]),
        "e2e_ms": percentiles([r.end - r.start for r in done]),
        "output_tokens": sum(r.completion_tokens or 0 for r in done),
        "problems": [problem(r) for r in problems[:PROBLEMS_LISTED]],
    }


def refusals(results: Sequence[Result]) -> list[dict]:
    """Refused requests grouped by status and error code, with up to three of their messages."""
    groups: dict[tuple[int, str], dict] = {}
    for r in results:
        if r.outcome != REFUSED:
            continue
        group = groups.setdefault((r.status or 0, r.code or "-"), {"status": r.status, "code": r.code, "count": 0,
                                                                   "reasons": []})  # fmt: skip
        group["count"] += 1
        if r.reason not in group["reasons"] and len(group["reasons"]) < 3:
            group["reasons"].append(r.reason)
    return sorted(groups.values(), key=lambda g: -g["count"])


def by_kind(results: Sequence[Result]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in results:
        row = out.setdefault(f"{r.kind} {'stream' if r.stream else 'whole'}", dict.fromkeys(OUTCOMES, 0))
        row[r.outcome] += 1
    return dict(sorted(out.items()))


def problem(r: Result) -> dict:
    """A lost request as the report lists it."""
    return {"index": r.index, "outcome": r.outcome, "kind": r.kind, "stream": r.stream, "start_s": round(r.start, 1),
            "end_s": round(r.end, 1), "deltas": r.deltas, "status": r.status, "attempts": r.attempts,
            "reason": r.reason}  # fmt: skip


def overlapping(results: Sequence[Result], start: float, end: float) -> list[Result]:
    """Requests in flight at any time within [start, end]."""
    return [r for r in results if r.start <= end and r.end >= start]


def answered_after(results: Sequence[Result], t: float) -> list[Result]:
    """Requests whose answer began after `t`. A whole (not streamed) answer begins with its one delta, so only one
    asked for after `t` counts: one asked before may have been computed before `t` and delivered just after it."""
    return [r for r in results if r.first_delta is not None and r.first_delta > t and (r.stream or r.start > t)]


def first_served_after(results: Sequence[Result], t: float) -> float | None:
    """When the first request whose answer began after `t` completed: the server answered again."""
    return min((r.end for r in answered_after(results, t) if r.outcome == COMPLETED), default=None)


def kill_report(target: str, pid: int, t_kill: float, results: Sequence[Result], restart: dict | None,
                until: float) -> dict:  # fmt: skip
    """One chaos kill: time to the first completed request after it, what serve said, and by outcome the requests
    it affected: in flight between the kill and that recovery (or `until` without one), and ended before `until`
    (the next kill, or the run's end: a request that lived through two kills counts for the one that ended it)."""
    served = first_served_after(results, t_kill)
    first_token = min((r.first_delta for r in answered_after(results, t_kill) if r.first_delta), default=None)
    window = overlapping(results, t_kill, served if served is not None else until)
    affected = [r for r in window if r.end < until]
    counts = Counter(r.outcome for r in affected)
    return {
        "target": target, "pid": pid, "t_kill_s": round(t_kill, 1),
        "recovery_s": round(served - t_kill, 1) if served is not None else None,
        "first_token_s": round(first_token - t_kill, 1) if first_token is not None else None,
        "serve_said": restart,
        "affected": len(affected), "outcomes": {o: counts.get(o, 0) for o in OUTCOMES},
        "lost_nothing_produced": counts.get(FAILED, 0), "cut": counts.get(CUT, 0),
        "cut_with_error_event": sum(r.outcome == CUT and r.error_event for r in affected),
        "client_retried": sum(r.attempts > 1 for r in affected),
    }  # fmt: skip


def targets(p: dict) -> list[dict]:
    """The issue's targets for this run, each with its measured value and whether it was met."""
    s, server = p["summary"], p["server"]
    crashes = server["crashes"]
    rows = [
        ("requests lost (neither completed, refused with a reason, nor cancelled)", s["lost"], "0",
         s["lost"] == 0),
        ("crashes (Fatal Python error in the logs, our processes' segfaults in the kernel log)",
         crashes["count"], "0", crashes["count"] == 0),
        ("serve's exit code after SIGTERM", server["exit_code"], "0", server["exit_code"] == 0),
    ]  # fmt: skip
    if p["mode"] == "soak":
        restarts = len(server["restarts"])
        rows.append(("server restarts (none expected: nothing was killed)", restarts, "0", restarts == 0))
    for k in p.get("kills", []):
        limit = RECOVERY_TARGETS_S[k["target"]]
        recovered = k["recovery_s"] is not None and k["recovery_s"] <= limit
        what = "stub stopped (SIGSTOP)" if k["target"] == "hang" else f"{k['target']} killed"
        rows += [(f"{what}: seconds to the first completed request", k["recovery_s"], f"<= {limit:g}", recovered),
                 (f"{what}: requests lost that had produced nothing", k["lost_nothing_produced"], "0",
                  k["lost_nothing_produced"] == 0)]  # fmt: skip
    if "kv_after" in server:
        kv = server["kv_after"]
        rows += [("KV cache usage ratio after the load", kv.get("usage_ratio"), "0", kv.get("usage_ratio") == 0),
                 ("KV blocks held by requests after the load", kv.get("used_blocks"), "0", kv.get("used_blocks") == 0),
                 ("serve healthy after (gateway /health 200, a request completed)", server.get("healthy_after"),
                  "True", server.get("healthy_after") is True)]  # fmt: skip
    return [{"name": n, "value": v, "target": t, "met": bool(m)} for n, v, t, m in rows]


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _ms(d: dict, key: str) -> str:
    return f"{d[key]:.0f}" if d.get(key) is not None else "-"


def render(p: dict) -> str:
    m, server, cfg = p["machine"], p["server"], p["config"]
    lines = [
        f"# Reliability: {p['mode']}" + (f" ({p['label']})" if p.get("label") else ""),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; run {p['date_utc']}, {p['wall_s']:.0f} s wall. "
        f"Command: `{p['command']}`",
        "",
        f"Server: `{' '.join(p['serve_command'])}` (ready after {server['ready_s']} s).",
        "",
        f"Workload: {p['workload']}",
        "",
        f"Load: {cfg['describe']}; {p['summary']['requests']} requests sent over {p['load']['arrivals_s']:.0f} s.",
        "",
        "## Targets",
        "",
        "| what | measured | target | met |",
        "|---|---|---|---|",
        *(f"| {t['name']} | {t['value']} | {t['target']} | {'yes' if t['met'] else '**no**'} |" for t in p["targets"]),
        "",
    ]
    lines += _outcomes(p) + _refusals(p["summary"])
    if p.get("tenants"):
        lines += render_tenants(p["tenants"], p["tenant_keys"])
    lines += _kills(p) + _server(p) + _problems(p["summary"])
    return "\n".join(lines) + "\n"


def _outcomes(p: dict) -> list[str]:
    s, patience = p["summary"], p["load"].get("read_timeout_s", 600)
    counts = [s["requests"], *(s["outcomes"][o] for o in OUTCOMES), s["lost"], s["lost_nothing_produced"],
              f"{s['client_retried']} ({s['client_retried_completed']})"]  # fmt: skip
    return [
        "## Requests by outcome",
        "",
        _row(["requests", *OUTCOMES, "lost", "lost, nothing produced", "client retried (completed)"]),
        "|" + "---|" * (len(OUTCOMES) + 4),
        _row(counts),
        "",
        "Cancelled: streams the client itself cancelled mid-stream. Cut: failed after producing deltas "
        f"({s['cut_with_error_event']} of them ended with an error event). Client retried: sent again because an "
        "attempt got no HTTP response at all (the gateway was down, or did not accept the connection within 5 s). "
        f"Lost to the client's patience (no bytes for {patience:g} s, the openai SDK's default read timeout): "
        f"{s['client_timeouts']}.",
        "",
        _row(["kind", *OUTCOMES]),
        "|---|" + "---|" * len(OUTCOMES),
        *(_row([kind, *(row[o] for o in OUTCOMES)]) for kind, row in s["by_kind"].items()),
        "",
    ]


def _refusals(s: dict) -> list[str]:
    if not s["refusals"]:
        return ["No request was refused.", ""]
    out = ["## Refusals", "", "| status | code | count | reasons (up to 3) |", "|---|---|---|---|"]
    out += [f"| {g['status']} | {g['code']} | {g['count']} | {'; '.join(str(x) for x in g['reasons'])} |"
            for g in s["refusals"]]  # fmt: skip
    return [*out, ""]


KILL_COLUMNS = ("killed", "at s", "recovery s", "first token s", "serve said", "affected", "completed", "refused",
                "cancelled", "lost, nothing produced", "cut (error event)", "client retried")  # fmt: skip


def _kills(p: dict) -> list[str]:
    if not p.get("kills"):
        return []
    out = ["## Kills", "",
           "Recovery: from the SIGKILL (hang: the stub's SIGSTOP) to the first completed request whose answer "
           "began after it (a stream's first delta, or a whole answer asked for after it; first token: to the first "
           "answer's first delta after it). Affected: requests in flight "
           "between the kill and that recovery.", "", _row(KILL_COLUMNS), "|" + "---|" * len(KILL_COLUMNS)]  # fmt: skip
    for k in p["kills"]:
        said, o = k["serve_said"], k["outcomes"]
        said_text = f"{said['child']}: serving again {said['serving_again_s']:g} s after seen" if said else "-"
        out.append(_row([f"{k['target']} (pid {k['pid']})", k["t_kill_s"], k["recovery_s"], k["first_token_s"],
                         said_text, k["affected"], o[COMPLETED], o[REFUSED], o[CANCELLED],
                         k["lost_nothing_produced"], f"{k['cut']} ({k['cut_with_error_event']})",
                         k["client_retried"]]))  # fmt: skip
    return [*out, ""]


def _server(p: dict) -> list[str]:
    s, server = p["summary"], p["server"]
    rss, crashes = server["peak_rss_mib"], server["crashes"]
    out = [
        "## Latency, memory, server",
        "",
        f"TTFT (streams with a first delta) p50 {_ms(s['ttft_ms'], 'p50')} ms, p99 {_ms(s['ttft_ms'], 'p99')} ms; "
        f"E2E (completed) p50 {_ms(s['e2e_ms'], 'p50')} ms, p99 {_ms(s['e2e_ms'], 'p99')} ms; "
        f"{s['output_tokens']} tokens in completed answers.",
        "",
        f"Peak RSS (sampled every {server['sample_s']:g} s): total {rss['total']} MiB = tritonserver "
        f"{rss['tritonserver']} + Python-backend stubs {rss['stubs']} + gateway {rss['gateway']} MiB (each part's own "
        "peak; the stubs' RSS includes the shared memory they map).",
        "",
        *_growth(p),
        f'Restarts (serve\'s "restarted" lines): {len(server["restarts"])}'
        + "".join(
            f"; {r['child']} at {r['t_s']} s, serving again {r['serving_again_s']:g} s after the failure was seen"
            for r in server["restarts"]
        )
        + ".",
        "",
        f'Crashes: {crashes["count"]} ("Fatal Python error" lines in {len(crashes["fatal_python_errors"])} Triton '
        f"and gateway logs: {sum(crashes['fatal_python_errors'].values())}; kernel-log lines of our processes: "
        f"{len(crashes['kernel_ours'])}"
        + ("" if crashes["dmesg_readable"] else ", dmesg not readable")
        + f"; other processes' segfaults on this shared machine meanwhile, not counted: "
        f"{len(crashes['kernel_others'])}).",
        "",
        _cpu(server.get("cpu")),
        "",
        f"Shutdown: SIGTERM after the load; serve exited with code {server['exit_code']} after {server['exit_s']} s.",
        "",
    ]
    if server.get("kv_after") is not None:
        out += [f"After the load: KV {server['kv_after']}; healthy: {server.get('healthy_after')}.", ""]
    if server["serve_errors"]:
        out += ["serve's error and warning lines:", "", "```", *server["serve_errors"][:30], "```", ""]
    return out


def _growth(p: dict) -> list[str]:
    """A burst's memory per stream: each part's growth from the first RSS sample to its peak."""
    timeline, streams = p["server"].get("rss_timeline_mib") or [], p["summary"]["requests"]
    if p["mode"] != "burst" or len(timeline) < 2 or not streams:
        return []
    first = timeline[0]
    stubs, gateway = (max(row[i] for row in timeline) - first[i] for i in (2, 3))
    return [
        f"Memory per stream: the gateway grew {gateway} MiB from its first sample ({first[0]:g} s) to its peak with "
        f"{streams} streams open ({gateway * 1024 / streams:.0f} KiB each; it holds the waiting ones), the stubs "
        f"{stubs} MiB (they see only the requests the gateway lets upstream, --max-concurrent at most).",
        "",
    ]


def _cpu(c: dict | None) -> str:
    if not c:
        return ""
    before = f"{c['busy_before']:.0%}" if c.get("busy_before") is not None else "-"
    return (f"CPU over the {c['wall_s']:.0f} s run, core-seconds: machine {c['machine_busy_core_s']}, trtserve's "
            f"processes {c['trtserve_core_s']}, this client {c['client_core_s']}, other work on these shared cores "
            f"{c['other_core_s']} (machine {before} busy just before the start).")  # fmt: skip


def _problems(s: dict) -> list[str]:
    if not s["problems"]:
        return []
    out = [f"## Lost requests (first {PROBLEMS_LISTED})", "",
           "| # | outcome | kind | stream | start s | end s | deltas | status | attempts | reason |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in s["problems"]:
        reason = str(x["reason"]).replace("|", "/").replace("\n", " ")[:200]
        out.append(_row([x["index"], x["outcome"], x["kind"], x["stream"], x["start_s"], x["end_s"], x["deltas"],
                         x["status"], x["attempts"], reason]))  # fmt: skip
    return [*out, ""]

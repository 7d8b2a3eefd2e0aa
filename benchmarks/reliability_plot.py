"""The reliability run's timeline PNG: each request's latency by outcome over the run, and the server's RSS, with
the kills and serve's restarts marked -- a leak is a rising RSS line, a lost request a red mark at its time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from benchmarks.reliability_client import CANCELLED, COMPLETED, CUT, FAILED, REFUSED, Result

STYLE = {COMPLETED: ("tab:green", "."), CANCELLED: ("tab:gray", "."), REFUSED: ("tab:orange", "x"),
         CUT: ("tab:red", "v"), FAILED: ("tab:red", "X")}  # fmt: skip


def timeline(p: dict, results: Sequence[Result], path: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    for outcome, (color, marker) in STYLE.items():
        picked = [r for r in results if r.outcome == outcome]
        if picked:
            waited = [(r.first_delta if r.first_delta is not None else r.end) - r.start for r in picked]
            top.scatter([r.start for r in picked], waited, s=10, c=color, marker=marker,
                        label=f"{outcome} ({len(picked)})")  # fmt: skip
    top.set_ylabel("s to the first delta\n(or to the end)")
    top.set_yscale("symlog", linthresh=1.0)
    top.legend(loc="upper left", fontsize=8)
    rss = p["server"]["rss_timeline_mib"]
    if rss:
        t = [row[0] for row in rss]
        for i, name in enumerate(("tritonserver", "stubs", "gateway"), start=1):
            bottom.plot(t, [row[i] for row in rss], label=name)
        bottom.plot(t, [sum(row[1:]) for row in rss], label="total", color="black")
    bottom.set_ylabel("RSS, MiB")
    bottom.set_xlabel("seconds after the load started")
    bottom.legend(loc="upper left", fontsize=8)
    for k in p.get("kills", []):
        for ax in (top, bottom):
            ax.axvline(k["t_kill_s"], color="tab:red", linestyle="--", linewidth=1)
        top.annotate(f"kill {k['target']}", (k["t_kill_s"], 1), rotation=90, fontsize=8, color="tab:red")
    for r in p["server"]["restarts"]:
        bottom.axvline(r["t_s"], color="tab:blue", linestyle=":", linewidth=1)
    top.set_title(f"reliability {p['mode']}" + (f" ({p['label']})" if p.get("label") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

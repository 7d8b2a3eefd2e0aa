"""PNG plots: the suite's (throughput vs concurrency, TTFT/ITL percentiles, prefix-cache TTFT) and those of
the routing, SLO, scale-out and speculative-decoding benchmarks."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def _measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("median")]


def throughput_vs_concurrency(rows: list[dict], path: Path) -> None:
    """Output tok/s (median, min–max bars) per system against concurrency or batch size."""
    fig, ax = plt.subplots(figsize=(8, 5))
    systems: dict[str, list[dict]] = {}
    for r in _measured(rows):
        if r["workload"].startswith("fixed"):
            key = r["system"] + (" (static batch)" if r["mode"].startswith("static batch") else "")
            systems.setdefault(key, []).append(r)
    for name, points in systems.items():
        points.sort(key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in points]
        ys = [r["median"]["output_tok_s"] for r in points]
        lo = [y - r["spread"]["output_tok_s"][0] for y, r in zip(ys, points, strict=True)]
        hi = [r["spread"]["output_tok_s"][1] - y for y, r in zip(ys, points, strict=True)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
    levels = sorted({r["concurrency"] for points in systems.values() for r in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests (serving) / batch size (offline)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs concurrency (fixed-length workload)")
    ax.grid(alpha=0.3)
    if not _empty(ax, list(systems.values())):
        ax.legend(fontsize=7)
    _save(fig, path)


def latency_percentiles(rows: list[dict], concurrency: int, path: Path) -> None:
    """TTFT and ITL p50/p90/p99 per system at one concurrency."""
    picked = [r for r in _measured(rows) if r["workload"].startswith("fixed") and r["concurrency"] == concurrency]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric in zip(axes, ("ttft_ms", "itl_ms"), strict=True):
        width = 0.8 / max(len(picked), 1)
        for i, r in enumerate(picked):
            values = [r["median"].get(f"{metric}_p{q}", 0) for q in (50, 90, 99)]
            ax.bar([q + i * width for q in range(3)], values, width, label=f"{r['system']} [{r['mode']}]")
        ax.set_xticks([q + 0.4 - width / 2 for q in range(3)], ["p50", "p90", "p99"])
        ax.set_ylabel("ms")
        ax.set_title(f"{metric.split('_')[0].upper()} at concurrency/batch {concurrency}")
        ax.grid(axis="y", alpha=0.3)
    if not _empty(axes[0], picked):
        axes[0].legend(fontsize=6)
    _save(fig, path)


def prefix_ttft(rows: list[dict], path: Path) -> None:
    picked = [r for r in _measured(rows) if r["workload"].startswith("shared")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(len(picked), 1)
    for i, r in enumerate(picked):
        values = [r["median"].get(f"ttft_ms_p{q}", 0) for q in (50, 90, 99)]
        ax.bar([q + i * width for q in range(3)], values, width, label=r["system"])
    ax.set_xticks([q + 0.4 - width / 2 for q in range(3)], ["p50", "p90", "p99"])
    ax.set_ylabel("TTFT ms")
    ax.set_title("Prompts sharing a ~1,000-token system prompt: TTFT")
    ax.grid(axis="y", alpha=0.3)
    if not _empty(ax, picked):
        ax.legend(fontsize=7)
    _save(fig, path)


def routing_quality_cost(payload: dict, path: Path) -> None:
    """benchmarks/routing.py: the cascade's accuracy vs strong-token share (offline curve, measured points)
    and accuracy / escalation over the threshold."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, curve in payload["curves"].items():
        left.plot([p["strong_token_share"] for p in curve], [p["accuracy"] for p in curve], marker=".",
                  drawstyle="steps-post", label=f"cascade, offline ({name})")  # fmt: skip
    for (system, row), marker in zip(payload["measured"].items(), "s^*", strict=False):
        m = row["median"]
        left.scatter([m["strong_token_share"]], [m["accuracy"]], s=110, marker=marker, color="black", zorder=3,
                     label=f"measured through the gateway: {system}")  # fmt: skip
    left.set(xlabel="share of generated tokens produced by the strong model", ylabel="accuracy (known answers)",
             title="Quality vs cost over the cascade threshold")  # fmt: skip
    curve = [p for p in payload["curves"]["all"] if math.isfinite(p["threshold"])]
    right.plot([p["threshold"] for p in curve], [p["accuracy"] for p in curve], marker=".", label="accuracy")
    right.plot([p["threshold"] for p in curve], [p["escalated"] for p in curve], marker=".", label="escalated")
    right.axvline(payload["threshold"], color="grey", ls="--", label=f"auto's threshold {payload['threshold']}")
    right.set(xlabel="cascade_threshold (mean token logprob of the small answer)", title="All questions")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


def itl_curves(curves: dict[str, dict[str, list[float]]], quantiles, modes: list[str], path: Path) -> None:
    """ITL (ms, log scale) at each percentile, one panel per load, one line per system."""
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 4.2), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes, strict=True):
        drawn = [(system, by_mode[mode]) for system, by_mode in curves.items() if by_mode.get(mode)]
        for system, curve in drawn:
            ax.plot(range(len(quantiles)), curve, marker=".", label=system)
        ax.set_xticks(range(len(quantiles)), [f"p{q:g}" for q in quantiles], rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(mode, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        _empty(ax, drawn)
    axes[0][0].set_ylabel("inter-token latency, ms")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goodput_vs_load(series: dict[str, dict[str, list[tuple[float, float]]]], xlabels: tuple[str, ...],
                    path: Path, ylabel: str = "goodput, req/s (TTFT ≤ 2 s, TPOT ≤ 200 ms)") -> None:  # fmt: skip
    """Goodput (req/s) against load, one panel per workload (title -> system -> [(load, goodput)])."""
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.5), squeeze=False)
    for ax, (title, systems), xlabel in zip(axes[0], series.items(), xlabels, strict=True):
        for system, points in systems.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=system)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if not _empty(ax, list(systems.values())):
            ax.legend(fontsize=7)
    _save(fig, path)


def scaleout(runs: dict[str, dict], path: Path) -> None:
    """benchmarks/scaleout.py: TTFT p50/p99 per routing run, and each replica's prefix-cache hit rate."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(runs)
    for i, q in enumerate((50, 99)):
        values = [runs[n].get(f"ttft_ms_p{q}") or 0 for n in names]
        left.bar([x + 0.4 * i for x in range(len(names))], values, 0.4, label=f"TTFT p{q}")
    left.set_xticks([x + 0.2 for x in range(len(names))], names, fontsize=8)
    left.set(ylabel="ms", title="Time to first token by routing policy")
    left.set_yscale("log")
    widest = max((len(runs[n]["replicas"]) for n in names), default=1)
    for j in range(widest):
        rates = [(runs[n]["replicas"][j]["hit_rate"] or 0) if j < len(runs[n]["replicas"]) else 0 for n in names]
        right.bar([x + j * 0.8 / widest for x in range(len(names))], rates, 0.8 / widest, label=f"replica {j}")
    right.set_xticks([x + 0.4 - 0.4 / widest for x in range(len(names))], names, fontsize=8)
    right.set(
        ylabel="prefix-cache hits / queries (prompt tokens)", ylim=(0, 1), title="Replicas' prefix-cache hit rate"
    )
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
        if not _empty(ax, names):
            ax.legend(fontsize=7)
    _save(fig, path)


def speedup_bars(panels: dict[str, dict[str, list[tuple[int, float, float, float]]]], ylabel: str,
                 path: Path) -> None:  # fmt: skip
    """benchmarks/spec_decode.py: speedup (median, min–max bars) per level, one bar per system, one panel
    per workload (title -> system -> [(level, median, min, max)]); 1.0 marks no change."""
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(6 * max(len(panels), 1), 4.5), squeeze=False)
    for ax, (title, systems) in zip(axes[0], panels.items(), strict=False):
        levels = sorted({c for points in systems.values() for c, *_ in points})
        width = 0.8 / max(len(systems), 1)
        for i, (system, points) in enumerate(systems.items()):
            by_level = {c: (m, lo, hi) for c, m, lo, hi in points}
            xs = [x + i * width for x, c in enumerate(levels) if c in by_level]
            meds = [by_level[c][0] for c in levels if c in by_level]
            err = [[by_level[c][0] - by_level[c][1] for c in levels if c in by_level],
                   [by_level[c][2] - by_level[c][0] for c in levels if c in by_level]]  # fmt: skip
            ax.bar(xs, meds, width, yerr=err, capsize=3, label=system)
        ax.axhline(1.0, color="grey", ls="--", lw=1)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(levels))], [f"c={c}" for c in levels])
        ax.set(ylabel=ylabel, title=title)
        ax.grid(axis="y", alpha=0.3)
        if not _empty(ax, list(systems.values())):
            ax.legend(fontsize=7)
    if not panels:
        _empty(axes[0][0], [])
    _save(fig, path)


def server_bars(panels: dict[str, dict[str, tuple[float, float, float]]], path: Path) -> None:
    """benchmarks/decode_chat.py: one bar per server (median, min–max error bars), one panel per metric
    (title -> server -> (median, min, max))."""
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 4.5), squeeze=False)
    for ax, (title, servers) in zip(axes[0], panels.items(), strict=False):
        names = list(servers)
        meds = [servers[n][0] for n in names]
        err = [[servers[n][0] - servers[n][1] for n in names], [servers[n][2] - servers[n][0] for n in names]]
        ax.bar(range(len(names)), meds, 0.6, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        _empty(ax, names)
    if not panels:
        _empty(axes[0][0], [])
    _save(fig, path)


def _empty(ax, picked: list[dict]) -> bool:
    if not picked:
        ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
    return not picked


def write_all(rows: list[dict], out_dir: Path, focus_concurrency: int, stem: str) -> list[Path]:
    paths = [out_dir / f"{stem}_throughput_vs_concurrency.png", out_dir / f"{stem}_latency_percentiles.png"]
    throughput_vs_concurrency(rows, paths[0])
    latency_percentiles(rows, focus_concurrency, paths[1])
    if any(r["workload"].startswith("shared") for r in rows):  # the prefix workload ran (--parts)
        paths.append(out_dir / f"{stem}_prefix_cache_ttft.png")
        prefix_ttft(rows, paths[-1])
    return paths


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

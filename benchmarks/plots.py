"""PNG plots of a suite run: throughput vs concurrency, TTFT/ITL percentiles, prefix-cache TTFT."""

from __future__ import annotations

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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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

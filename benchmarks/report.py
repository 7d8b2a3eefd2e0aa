"""Shared benchmark output: machine description, JSON and markdown files in results/."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from builder.engine_dir import package_versions

RESULTS_DIR = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def cpu_busy_fraction(window_s: float = 3.0) -> float | None:
    """Share of all cores' time spent busy at normal priority over the next `window_s` (/proc/stat).

    A busy machine ruins multi-threaded CPU numbers. Unlike the load average, which decays
    over minutes and so also counts work that has already ended, this sees only work running
    now."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        # total, idle + iowait + nice: niced work yields the cores (CFS weight 15 against 1024), so
        # a niced job running beside a benchmark does not count as busy.
        return sum(fields), fields[3] + fields[4] + fields[1]

    try:
        total0, idle0 = sample()
        time.sleep(window_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(1 - (idle1 - idle0) / max(total1 - total0, 1), 3)


def write_results(name: str, results: dict, markdown: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": package_versions(),
        **results,
    }
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / f"{name}.md").write_text(markdown)
    return RESULTS_DIR / f"{name}.md"


def write_report(name: str, results: dict, render: Callable[[dict], str]) -> tuple[Path, dict]:
    """results/<name>.json, then <name>.md rendered from it as written (with machine and versions);
    returns the markdown's path and the payload as written, for the plots."""
    md = write_results(name, results, "")
    full = json.loads(md.with_suffix(".json").read_text())
    md.write_text(render(full))
    return md, full


# A column of a configurations report: its header, and its cell from one configuration's runs.
Column = tuple[str, Callable[[list[dict]], str]]


def median_cell(key: str, digits: int) -> Callable[[list[dict]], str]:
    """A configurations-report cell: the median of `key` over the runs that have it ("-" where none has)."""

    def cell(runs: list[dict]) -> str:
        values = [r[key] for r in runs if r.get(key) is not None]
        return f"{statistics.median(values):.{digits}f}" if values else "-"

    return cell


def configurations_report(p: dict, title: str, each_in: str, columns: list[Column]) -> str:
    """Markdown comparing configurations run alternately (p["runs"]: label -> runs): per configuration its median
    (min–max) output tok/s, then `columns`, then its median tok/s over the first configuration's."""
    first = next(iter(p["runs"]))
    lines = [
        f"# {title}",
        "",
        f"Machine: {p['machine']['cpu']}, {p['machine']['cores']} cores; run {p['date_utc']}. "
        f"Command: `{p['command']}`",
        "",
        f"Workload: {p['workload']}. Median (min–max) of {p['repetitions']} runs, configurations alternated, each in "
        f"{each_in}.",
        "",
        "| " + " | ".join(["configuration", "output tok/s", *(h for h, _ in columns), f"vs {first}"]) + " |",
        "|" + "---|" * (len(columns) + 3),
    ]
    base = None
    for label, runs in p["runs"].items():
        tok = [r["output_tok_s"] for r in runs]
        med = statistics.median(tok)
        base = base or med
        cells = [label, f"{med:.0f} ({min(tok):.0f}–{max(tok):.0f})", *(cell(runs) for _, cell in columns)]
        lines.append("| " + " | ".join([*cells, f"{med / base:.2f}x"]) + " |")
    return "\n".join(lines) + "\n"


def write_configurations(name: str, command: str, workload: str, runs: dict[str, list[dict]], repetitions: int,
                         render: Callable[[dict], str]) -> Path:  # fmt: skip
    """Write a configurations comparison (the payload configurations_report reads); returns the markdown's path."""
    payload = {"command": command, "workload": workload, "repetitions": repetitions, "runs": runs}
    md, _ = write_report(name, payload, render)
    return md

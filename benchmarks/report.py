"""Shared benchmark output: machine description, JSON and markdown files in results/."""

from __future__ import annotations

import json
import os
import platform
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

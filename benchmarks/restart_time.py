"""`python -m benchmarks.restart_time`: how long `trtserve serve` takes to serve again after its model's stub dies.

An idle server (no load: the restart alone, not the backlog a loaded one then works through; the chaos benchmark,
benchmarks.reliability, measures that). Starts `trtserve serve` as a user would, then --kills times: SIGKILL the
model's stub, wait for serve's "restarted: serving again N s after the failure was seen" line, settle, again.

    python -m benchmarks.restart_time --engine engines/smollm2-135m-b32 [--kills 3] [--label L]

Results: results/restart-time[-L].{json,md}. To compare two checkouts, run it on each (alternating).
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import click

from benchmarks import report
from benchmarks.reliability_serve import Serve

RESTART_WAIT_S = 120.0
SETTLE_S = 3.0  # after ready (or a restart) before the next kill: the gateway's probes see it healthy


def measure(engine: Path, kills: int, log_path: Path) -> dict:
    serve = Serve(engine, None, log_path)
    try:
        ready_s = serve.wait_ready()
        again: list[float | None] = []
        for _ in range(kills):
            time.sleep(SETTLE_S)
            stub, before = serve.model_stub(), len(serve.restarts())
            if stub is None:
                raise RuntimeError("no model stub found under tritonserver")
            os.kill(stub, signal.SIGKILL)
            start = time.monotonic()
            while len(serve.restarts()) <= before and time.monotonic() - start < RESTART_WAIT_S:
                time.sleep(0.2)
            restarts = serve.restarts()
            again.append(restarts[before][2] if len(restarts) > before else None)
    finally:
        exit_code, _ = serve.terminate()
    return {"serve_command": serve.command, "ready_s": ready_s, "serving_again_s": again, "exit_code": exit_code}


def render(p: dict) -> str:
    m, seen = p["machine"], [s for s in p["serving_again_s"] if s is not None]
    median = f"{statistics.median(seen):.1f} ({min(seen):.1f}-{max(seen):.1f})" if seen else "-"
    return "\n".join(
        [
            "# Restart time: serving again after the model's stub is killed (idle server)",
            "",
            f"Machine: {m['cpu']}, {m['cores']} cores; {p['date_utc']}. Command: `{p['command']}`",
            "",
            f"Server: `{' '.join(p['serve_command'])}`, ready after {p['ready_s']} s; exit code {p['exit_code']}.",
            "",
            "Serving again (serve's restart line: from the failure seen to the replacement ready), s: median (min-max) "
            f"{median}; each kill: {', '.join(str(s) for s in p['serving_again_s'])}.",
            "",
        ]
    )


@click.command()
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--kills", default=3, show_default=True, type=click.IntRange(1))
@click.option("--label", default=None, help="Results name suffix: restart-time-<label>.")
def main(engine: Path, kills: int, label: str | None) -> None:
    """Kill the model's stub --kills times on an idle `trtserve serve`; report each restart's length."""
    name = "restart-time" + (f"-{label}" if label else "")
    log_path = report.RESULTS_DIR / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    payload = measure(engine, kills, log_path)
    payload["command"] = f"python -m benchmarks.restart_time --engine {engine} --kills {kills}" + (
        f" --label {label}" if label else ""
    )
    md, _ = report.write_report(name, payload, render)
    click.echo(md.read_text())


if __name__ == "__main__":
    main()

"""CPU accounting and placement shared by the serving benchmarks.

Accounting: CPU seconds of a server's process session, of the whole machine, and a wait for other
work to stop (helpers share these 2 cores). Placement: servers started inside `pinned(cores)`
inherit that CPU mask from the fork, as under `taskset -c`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from benchmarks.report import cpu_busy_fraction


def _stat_fields(stat: Path) -> list[str] | None:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()  # fields after the command name
    except (OSError, IndexError):
        return None


def session_pids(leader: int) -> list[int]:
    """Live processes in `leader`'s session (tritonserver + its Python stubs)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields and int(fields[3]) == leader:  # field 6 (session id)
            out.append(int(stat.parent.name))
    return out


def session_cpu_s(leader: int) -> float:
    """CPU seconds of every live process in `leader`'s session."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in session_pids(leader):
        fields = _stat_fields(Path(f"/proc/{pid}/stat"))
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / tick


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(log: Callable[[str], None], limit_s: float = 90.0, busy: float = 0.2) -> float:
    """Wait (up to limit_s) until other work stops. Returns seconds waited."""
    start = time.monotonic()
    while (share := cpu_busy_fraction(2.0)) is not None and share > busy and time.monotonic() - start < limit_s:
        log(f"  machine {share:.0%} busy with other work; waiting")
    return round(time.monotonic() - start, 1)


def alternate(
    configs: dict[str, Callable[[], dict]], repetitions: int, log: Callable[[str], None]
) -> dict[str, list[dict]]:
    """Each configuration's results: `repetitions` rounds running every configuration in turn, each once the
    machine is quiet, so that a drift of the machine falls on all of them alike."""
    runs: dict[str, list[dict]] = {}
    for _ in range(repetitions):
        for label, run in configs.items():
            wait_quiet(log)
            result = run()
            log(f"{label}: {result}")
            runs.setdefault(label, []).append(result)
    return runs


@contextlib.contextmanager
def pinned(cores: Collection[int] | None) -> Iterator[None]:
    """Processes started inside run on `cores` (None: unchanged): this thread's CPU mask, which a
    fork copies (every thread of the child, and its children, start with it)."""
    if cores is None:
        yield
        return
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)


def session_affinity(leader: int) -> dict[str, int]:
    """CPU mask ("0" / "0,1") -> number of threads with it, over `leader`'s session (verifies a pin)."""
    masks: dict[str, int] = {}
    for pid in session_pids(leader):
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(int(task.name))))
                masks[cpus] = masks.get(cpus, 0) + 1
    return masks

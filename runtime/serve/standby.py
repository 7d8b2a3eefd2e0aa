"""How much memory there is for `trtserve serve`'s warm spare, and how much the serving engine takes.

The spare is on by default where the memory available holds a second engine (runtime/cli_standby.py decides
before the first engine starts, from an estimate); once the first serves, its measured size decides again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.serve.launcher import process_stat

STANDBY_ENV = "TRTSERVE_STANDBY"  # --standby (1) / --no-standby (0) from the environment
GiB = 2**30
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Memory:
    available: int  # bytes a new allocation can take (MemAvailable, or a cgroup's limit less its usage)
    total: int

    @property
    def reserve(self) -> int:
        """Left free beside the engines: the gateway, requests in flight, the page cache the disk tier reads."""
        return max(2 * GiB, self.total // 10)


def group_rss(pgid: int) -> int:
    """Resident bytes of the processes in process group `pgid` (a tritonserver and its model's stub)."""
    total = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int(process_stat(int(proc.name))[2]) == pgid:
                total += int((proc / "statm").read_text().split()[1]) * PAGE_BYTES  # resident pages
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return total


def spare_fits(serving_pgid: int, memory: Memory) -> str | None:
    """Before the spare starts: whether memory holds another engine the size the serving one measures now (None), or
    why not."""
    size = group_rss(serving_pgid)
    if memory.available < size + memory.reserve:
        return (
            f"{memory.available / GiB:.1f} GiB of memory available, a second engine of {size / GiB:.1f} GiB and the "
            f"reserve need {(size + memory.reserve) / GiB:.1f}"
        )
    return None

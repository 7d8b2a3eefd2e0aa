"""How much memory there is for `trtserve serve`'s warm spare, and how much the serving engine takes.

The spare is on by default where the memory available holds a second engine (runtime/cli_standby.py decides
before the first engine starts, from an estimate); once the first serves, its measured size decides again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STANDBY_ENV = "TRTSERVE_STANDBY"  # --standby (1) / --no-standby (0) from the environment
GiB = 2**30


@dataclass(frozen=True)
class Memory:
    available: int  # bytes that can be allocated without swapping or the cgroup's limit: free and reclaimable
    total: int

    @property
    def reserve(self) -> int:
        """Left free beside the engines: the gateway, requests in flight, the page cache the disk tier reads."""
        return max(2 * GiB, self.total // 10)


def host_memory() -> Memory:
    """/proc/meminfo's MemAvailable, lowered to what the cgroup's limit leaves (a container's limit)."""
    info = _key_values(Path("/proc/meminfo"))
    available, total = info.get("MemAvailable", 0) * 1024, info.get("MemTotal", 0) * 1024
    for limit_file, usage_file, stat_file, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
    ):
        root = Path("/sys/fs/cgroup")
        try:
            limit = int((root / limit_file).read_text())
            usage = int((root / usage_file).read_text()) - _key_values(root / stat_file).get(inactive, 0)
        except (OSError, ValueError):
            continue
        if limit < total:
            available, total = min(available, limit - usage), limit
        break
    return Memory(max(available, 0), total)


def _key_values(path: Path) -> dict[str, int]:
    """ "key value [kB]" lines (meminfo, memory.stat); {} when the file cannot be read."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.replace(":", " ").split() for line in lines)
    return {p[0]: int(p[1]) for p in pairs if len(p) >= 2 and p[1].isdigit()}


def group_rss(pgid: int) -> int:
    """Resident bytes of the processes in process group `pgid` (a tritonserver and its model's stub)."""
    total = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
                total += _key_values(proc / "status").get("VmRSS", 0) * 1024
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

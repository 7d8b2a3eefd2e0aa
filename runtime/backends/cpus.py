"""How many cores the CPU backends' thread pools should use."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The cores this process may run on (taskset, cpusets), not the machine's count: a replica
    pinned to one core must not run two ORT / OpenMP threads that fight over it."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1

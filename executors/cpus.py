"""The CPU backends' threads: how many cores they should use, and whether OpenMP is already loaded."""

from __future__ import annotations

import functools
import os
from pathlib import Path


def usable_cpus() -> int:
    """The cores this process may run on (taskset, cpusets), not the machine's count: a replica
    pinned to one core must not run two ORT / OpenMP threads that fight over it."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def libgomp_loaded() -> bool:
    """Whether this process has loaded libgomp, which reads its OpenMP settings (wait policy, spin
    count) once, when it loads."""
    maps = Path("/proc/self/maps")
    return maps.exists() and "libgomp" in maps.read_text()


@functools.cache
def amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices on AMX tiles (Sapphire Rapids and later Xeons), where the
    cpu-bf16 backend measured faster than `cpu` per step and served (docs/performance.md, "cpu-bf16 vs cpu")."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo.splitlines())

"""The CPU backends' threads: how many cores they should use, and whether OpenMP is already loaded."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

SPIN_COUNT = "100000"  # libgomp spins ~100,000 per ms (its own estimate)


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


def spin_openmp_workers(backend: str) -> None:
    """Let OpenMP workers spin ~1 ms before sleeping (GOMP_SPINCOUNT), for backends whose steps are hundreds of
    the kernel module's parallel regions microseconds apart: a sleeping worker costs a futex wake-up each time
    (93 vs 38 ms for a 64-token chunk on cpu-bf16). libgomp reads it once, when it loads: call this at import,
    before the kernel module or torch loads it. The first CPU backend imported in a process sets the policy for
    all of them (the `cpu` backend wants them passive, between ONNX Runtime runs)."""
    if "GOMP_SPINCOUNT" not in os.environ and libgomp_loaded():
        logging.getLogger(__name__).warning(
            "libgomp was loaded before the %s backend could set GOMP_SPINCOUNT: its steps will be slower; export "
            "GOMP_SPINCOUNT=%s or create the engine before importing torch",
            backend,
            SPIN_COUNT,
        )
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split()[2:])


def amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices on AMX tiles (Sapphire Rapids and later Xeons), where the
    cpu-bf16 backend measured faster than `cpu` per step and served (docs/performance.md, "cpu-bf16 vs cpu")."""
    return "amx_bf16" in cpu_flags()


def bf16_matmul() -> bool:
    """Whether torch's oneDNN multiplies bfloat16 on this CPU (the cpu-bf16 backend's dense layers): it needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and refuses elsewhere (e.g. AVX2-only CPUs)."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def int8_simd() -> bool:
    """Whether this CPU multiplies int8 in the vector loops of the cpu-int8 kernel: AVX512-VNNI (Ice Lake and later
    Xeons, Zen 4), where its dense layers run ~3x faster than float32's, or AVX2 (16-bit multiply-adds, exact too:
    1.3-2.4x on a Zen 3 EPYC; benchmarks/results/decode_profile*.md). Read from the flags, not the kernel module, whose
    loading would set OpenMP's policy before the backend chooses it."""
    flags = cpu_flags()
    return {"avx512_vnni", "avx512bw"} <= flags or "avx2" in flags

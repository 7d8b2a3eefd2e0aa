"""The KV pool memory shared by the CPU backends.

One C-contiguous allocation [layers, 2 (K, V), num_blocks, block_size, kv_width]: each
layer's K and V are contiguous views, which both ONNX Runtime (bound zero-copy) and the
paged-attention kernel read in place.

The pool is committed at start-up: np.zeros maps pages lazily (calloc), so a pool larger than
memory used to start fine and die of an OOM kill under load, as blocks filled. Now the bytes it
needs are checked against the memory available (MemAvailable, and the cgroup's limit) first, and
every page is written once.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import numpy.typing as npt

from engine_format import EngineConfig

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


class PoolMemoryError(MemoryError):
    """The KV pool does not fit in the memory available: a start-up error naming both sizes."""


def available_memory() -> tuple[int, str] | None:
    """(bytes a new allocation can take, where that figure comes from), or None where unknown."""
    limits: list[tuple[int, str]] = []
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in _cgroup_files():
        try:
            limit = limit_file.read_text().strip()
            if limit != "max" and int(limit) < 2**60:  # v1 writes "no limit" as a huge number
                headroom = max(int(limit) - int(usage_file.read_text()), 0)
                limits.append((headroom, f"cgroup limit {limit_file} less usage"))
                break
        except (OSError, ValueError):
            continue
    return min(limits) if limits else None


def _cgroup_files() -> list[tuple[Path, Path]]:
    """(limit, usage) files of this process's memory cgroup, v2 then v1; inside a container the group
    is often the mount's root, so that is tried too."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    candidates = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            dirs = (CGROUP / group.lstrip("/"), CGROUP)
            candidates += [(d / "memory.max", d / "memory.current") for d in dirs]
        elif "memory" in controllers.split(","):
            dirs = (CGROUP / "memory" / group.lstrip("/"), CGROUP / "memory")
            candidates += [(d / "memory.limit_in_bytes", d / "memory.usage_in_bytes") for d in dirs]
    return candidates


def allocate_pool(config: EngineConfig, num_blocks: int, dtype: npt.DTypeLike) -> np.ndarray:
    spec = config.model
    shape = (spec.num_layers, 2, num_blocks, config.block_size, spec.kv_width)
    needed = math.prod(shape) * np.dtype(dtype).itemsize
    available = available_memory()
    if available is not None and needed > available[0]:
        raise PoolMemoryError(
            f"the KV pool ({num_blocks} blocks x {config.block_size} tokens) needs {needed:,} bytes "
            f"({needed / 2**30:.2f} GiB) but only {available[0]:,} bytes ({available[0] / 2**30:.2f} GiB) "
            f"are available ({available[1]}): lower --num-kv-blocks"
        )
    pool = np.empty(shape, dtype)
    pool.fill(0)  # writes every page: the memory is committed now, not under load
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB",
        num_blocks, config.block_size, num_blocks * config.block_size, pool.nbytes / 2**20,
    )  # fmt: skip
    return pool


def pool_rows(pool: np.ndarray) -> np.ndarray:
    """View [2*layers, num_blocks*block_size, kv_width]: row `slot` of each layer's K or V."""
    layers, _, blocks, block_size, width = pool.shape
    return pool.reshape(2 * layers, blocks * block_size, width)

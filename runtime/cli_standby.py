"""Whether `trtserve serve` keeps a warm spare: on by default where the host's memory holds a second engine.

A spare (a second tritonserver with the engine loaded) turns a dead model's outage into a failover: its requests and
streams go on there at once, and with a KV disk tier the two share, the spare reads the KV the dead engine wrote
instead of computing it again (benchmarks/results/HISTORY.md: the first new answer 2-3 s after a stub's death
instead of ~21 s). It costs a second engine's memory and, on a 2-core VM, some speed: the disk tier's writes (each
full block once, on a thread of its own) ~5% of decode-heavy throughput, the idle spare's heartbeat and probes ~7%
of a single stream's TPOT. So it is started wherever that memory is there: for engines whose backend runs on the CPU
(a GPU's memory is the engine's KV cache: a second engine there would halve it), when the memory available holds the
engine twice over plus a reserve. The estimate decides here, before the first engine starts (the disk tier both must
share is set then); the first engine's measured size decides again before the spare starts
(runtime/serve/standby.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine_format import EngineConfig
from executors.factory import HOST_MEMORY_BACKENDS, default_backend
from executors.kv_pool import available_memory, pool_bytes
from runtime.engine.engine_args import DEFAULT_KV_DISK_CACHE_GB, EngineArgs
from runtime.serve.standby import GiB, Memory

RUNTIME_BYTES = int(1.5 * GiB)  # an engine's process beyond weights and KV: Python, torch, ONNX Runtime, Triton
DISK_SHARE = 0.25  # of the free space where the default disk tier goes


def host_memory() -> Memory:
    """What the KV pool's own check reads (MemAvailable, lowered to a cgroup's headroom; 0 where unknown), and the
    machine's memory."""
    available = available_memory()
    return Memory(available[0] if available else 0, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def engine_bytes(config: EngineConfig, args: EngineArgs) -> int:
    """An engine's process as estimated before it runs: its directory's files (weights), its KV pool, the runtime."""
    files = sum(f.stat().st_size for f in config.engine_dir.iterdir() if f.is_file())
    blocks = args.num_kv_blocks or config.max_batch_size * config.max_blocks_per_seq
    return files + pool_bytes(config, blocks) + RUNTIME_BYTES


@dataclass(frozen=True)
class StandbyPlan:
    start: bool  # a spare is to start once the first engine is ready
    required: bool  # asked for with --standby: started whatever memory says (a warning if it cannot)
    message: str  # what serve prints about it
    engine_args: EngineArgs  # with the disk tier the two engines share
    disk_dir: Path | None = None  # a disk tier made for this server (removed when it stops)

    def cleanup(self) -> None:
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir, ignore_errors=True)


def plan_standby(choice: bool | None, config: EngineConfig, args: EngineArgs, memory: Memory) -> StandbyPlan:
    """--standby (True), --no-standby (False) or neither (None: where memory allows, for a CPU backend)."""
    if choice is False:
        return StandbyPlan(False, False, "", args)
    backend = args.backend or default_backend(config)
    if choice is None and (refused := _refusal(backend, config, args, memory)):
        return StandbyPlan(False, False, f"no warm spare: {refused} (--standby starts one anyway)", args)
    message = "a warm spare will start once the engine serves (--no-standby: none)"
    if args.kv_disk_cache is not None or backend not in HOST_MEMORY_BACKENDS:  # (a tier the user set up, if any)
        return StandbyPlan(True, choice is True, message, args)
    directory = Path(tempfile.mkdtemp(prefix="trtserve-kv-"))
    gb = min(DEFAULT_KV_DISK_CACHE_GB, shutil.disk_usage(directory).free * DISK_SHARE / GiB)
    shared = dataclasses.replace(args, kv_disk_cache=str(directory), kv_disk_cache_gb=round(max(gb, 0.001), 3))
    message += f"; the KV disk tier the two share: {directory} ({gb:.1f} GiB, removed at exit)"
    return StandbyPlan(True, choice is True, message, shared, directory)


def _refusal(backend: str, config: EngineConfig, args: EngineArgs, memory: Memory) -> str | None:
    if backend not in HOST_MEMORY_BACKENDS:
        return f"the {backend} backend's engine is in a GPU's memory"
    need = 2 * engine_bytes(config, args) + memory.reserve
    if memory.available < need:
        return f"{memory.available / GiB:.1f} GiB of memory available, two engines need ~{need / GiB:.1f} GiB"
    return None

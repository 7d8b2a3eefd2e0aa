"""A hierarchical KV cache: the prefix cache's blocks live on in host memory and on disk (tiers.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from engine_format import EngineConfig
from engine_format.kv_identity import kv_identity
from executors.kv_blocks import BlockCopier
from runtime.engine.block_pool import BlockPool
from runtime.engine.kv_tiers.disk import DiskTier
from runtime.engine.kv_tiers.host import HostTier
from runtime.engine.kv_tiers.tiers import KVTiers, TierStats

log = logging.getLogger(__name__)

__all__ = ["KVTiers", "TierStats", "create_tiers"]

GB = 2**30


def create_tiers(
    config: EngineConfig, backend: Any, pool: BlockPool, host_gb: float, disk_dir: str | None, disk_gb: float
) -> KVTiers | None:
    """The tiers the settings ask for (None: none). ValueError for a backend whose pool cannot be copied; a disk
    directory that cannot be used is a warning, and the engine serves without that tier."""
    if host_gb <= 0 and disk_dir is None:
        return None
    try:
        copier = BlockCopier(backend, config)
    except ValueError as exc:
        tiers = "the KV cache tiers (--kv-host-cache-gb, --kv-disk-cache)"
        raise ValueError(f"{tiers} need a backend whose KV pool they can copy: {exc}") from None
    host = HostTier(int(host_gb * GB)) if host_gb > 0 else None
    disk = None
    if disk_dir is not None:
        identity = {**kv_identity(config), **dataclasses.asdict(copier.layout), "block_bytes": copier.block_bytes}
        try:
            disk = DiskTier(disk_dir, int(disk_gb * GB), identity, copier.block_bytes)
        except OSError as exc:
            log.warning("KV disk tier %s cannot be used (%s): serving without it", disk_dir, exc)
    if host is None and disk is None:
        return None
    sizes = ", ".join(f"{t.name} {t.capacity_bytes / GB:g} GiB" for t in (host, disk) if t is not None)
    log.info("KV cache tiers: %s (%d bytes a block)", sizes, copier.block_bytes)
    return KVTiers(copier, pool, host, disk)

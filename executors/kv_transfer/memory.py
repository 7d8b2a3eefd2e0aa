"""A backend's KV pool as memory a transfer library can register and address: its regions and their blocks.

Both pools (executors/kv_pool.py's numpy KVPool on CPU, executors/torch/kv_cache.py's TorchKVPool) are
C-contiguous [layers, 2, pool_blocks, block_size, kv_width] arrays (and, for int8, scales of the same leading
shape), so one block of one layer's K or V is one contiguous run of block_size * width * itemsize bytes. A
request's KV is those runs for each (layer, K|V) and each of its blocks: `block_descriptors` lists them, in
one order on both sides of a transfer (region, layer, K|V, block), so the i-th local run receives the i-th
remote one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engine_format.kv_handle import KVLayout, KVRegion


@dataclass(frozen=True)
class KVMemory:
    """The pool's regions (what is registered, and what a handle tells a peer) and the buffers behind them
    (held here so they outlive the registration)."""

    layout: KVLayout
    regions: tuple[KVRegion, ...]
    buffers: tuple[Any, ...]

    def descriptors(self, block_ids: Sequence[int]) -> np.ndarray:
        return block_descriptors(self.regions, self.layout.num_layers, block_ids)

    def region_bytes(self, region: KVRegion) -> int:
        return self.layout.num_layers * 2 * region.pool_blocks * region.block_bytes

    def bytes_per_block(self) -> int:
        """Bytes one block of every layer, K and V, scales included, takes: what a transfer moves per block."""
        return sum(self.layout.num_layers * 2 * r.block_bytes for r in self.regions)


def block_descriptors(regions: Sequence[KVRegion], num_layers: int, block_ids: Sequence[int]) -> np.ndarray:
    """[N, 3] uint64 rows (address, bytes, device): each region's (layer, K|V, block) runs, in that order."""
    blocks = np.asarray(block_ids, dtype=np.uint64)
    rows = []
    for region in regions:
        planes = np.arange(2 * num_layers, dtype=np.uint64)[:, None] * np.uint64(region.pool_blocks)
        starts = np.uint64(region.address) + (planes + blocks[None, :]) * np.uint64(region.block_bytes)
        flat = starts.reshape(-1)
        rows.append(np.stack([flat, np.full_like(flat, region.block_bytes), np.full_like(flat, region.device)], axis=1))
    return np.concatenate(rows) if rows else np.zeros((0, 3), np.uint64)


def kv_memory(backend: Any, layout: KVLayout) -> KVMemory:
    """The memory of `backend`'s KV pool (its `kv`: a KVPool, or a TorchKVPool on CPU or CUDA); ValueError for a
    backend whose pool is not laid out as [layers, 2, blocks, block_size, width] (the TensorRT backend's)."""
    pool = getattr(backend, "kv", None)
    data = getattr(pool, "data", None)
    if data is None:
        raise ValueError(f"the {type(backend).__name__} backend exposes no KV pool to transfer from")
    if layout.kv_cache_dtype == "auto":  # a float pool holds the compute dtype (torch's --dtype), not the engine's
        layout = replace(layout, dtype=str(data.dtype).removeprefix("torch."))
    regions = [_region("data", data, layout)]
    buffers = [data]
    scales = getattr(pool, "scales", None)
    if scales is not None and len(scales.shape) == 5:  # int8 row scales; fp8's are static per layer, not blocks
        regions.append(_region("scales", scales, layout))
        buffers.append(scales)
    return KVMemory(layout, tuple(regions), tuple(buffers))


def _region(name: str, array: Any, layout: KVLayout) -> KVRegion:
    shape = tuple(array.shape)
    if len(shape) != 5 or shape[:2] != (layout.num_layers, 2) or shape[3] != layout.block_size:
        raise ValueError(f"KV {name} has shape {shape}, not [{layout.num_layers}, 2, blocks, {layout.block_size}, w]")
    if hasattr(array, "data_ptr"):  # torch
        if not array.is_contiguous():
            raise ValueError(f"KV {name} is not contiguous")
        address, itemsize = int(array.data_ptr()), int(array.element_size())
        on_gpu = array.device.type == "cuda"
        memory, device = ("VRAM", int(array.device.index or 0)) if on_gpu else ("DRAM", 0)
    else:
        if not array.flags["C_CONTIGUOUS"]:
            raise ValueError(f"KV {name} is not C-contiguous")
        address, itemsize, memory, device = int(array.ctypes.data), int(array.itemsize), "DRAM", 0
    return KVRegion(name, address, shape[2], shape[3] * shape[4] * itemsize, memory, device)

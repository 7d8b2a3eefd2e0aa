"""Whole KV blocks copied out of a backend's pool and back: what the KV cache's host and disk tiers store.

A block's payload is one row of bytes: for each of the pool's buffers (the K/V data, and an int8 pool's row
scales) its [layers, 2, block_size, width] values, in that order, as the pool holds them. A quantized pool
stays quantized, and a payload written by one engine is valid in any engine with the same KV identity
(engine_format/kv_identity.py) and layout. Works on numpy pools (the CPU backends) and torch pools on the CPU
or a GPU (a device pool is copied through host memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_format import EngineConfig
from engine_format.kv_identity import kv_layout
from executors.kv_transfer.memory import kv_memory


class BlockCopier:
    """Gathers and scatters whole blocks of a backend's KV pool; ValueError for a backend without one."""

    def __init__(self, backend: Any, config: EngineConfig) -> None:
        memory = kv_memory(backend, kv_layout(config))
        self.buffers = memory.buffers
        self.block_bytes = memory.bytes_per_block()
        self.layout = memory.layout
        # Each buffer's share of a payload row: its bytes per block, and the payload's column where it starts.
        self._widths = [self._nbytes(b) // int(b.shape[2]) for b in self.buffers]
        self._starts = np.cumsum([0, *self._widths]).tolist()

    @staticmethod
    def _nbytes(buffer: Any) -> int:
        return int(buffer.numel() * buffer.element_size()) if hasattr(buffer, "data_ptr") else int(buffer.nbytes)

    def gather(self, block_ids: Sequence[int]) -> np.ndarray:
        """[len(block_ids), block_bytes] uint8: each block's payload (a copy)."""
        out = np.empty((len(block_ids), self.block_bytes), np.uint8)
        for buffer, start, width in zip(self.buffers, self._starts, self._widths, strict=False):
            out[:, start : start + width] = gather_blocks(buffer, block_ids)
        return out

    def scatter(self, block_ids: Sequence[int], payloads: np.ndarray) -> None:
        """Write payload rows ([len(block_ids), block_bytes] uint8) into the blocks."""
        if payloads.shape != (len(block_ids), self.block_bytes):
            raise ValueError(f"payloads have shape {payloads.shape}, not ({len(block_ids)}, {self.block_bytes})")
        for buffer, start, width in zip(self.buffers, self._starts, self._widths, strict=False):
            scatter_blocks(buffer, block_ids, payloads[:, start : start + width])


def gather_blocks(buffer: Any, block_ids: Sequence[int]) -> np.ndarray:
    """[n, bytes per block] uint8 of a pool buffer's blocks ([layers, 2, blocks, ...] -> [n, layers, 2, ...]): a
    numpy array, or a torch tensor on the CPU or a device."""
    n = len(block_ids)
    if hasattr(buffer, "data_ptr"):  # torch, on the CPU or a GPU
        import torch

        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=buffer.device)
        picked = buffer.index_select(2, index).movedim(2, 0).contiguous()
        return picked.view(torch.uint8).reshape(n, -1).cpu().numpy()
    picked = np.moveaxis(buffer[:, :, list(block_ids)], 2, 0)
    return np.ascontiguousarray(picked).view(np.uint8).reshape(n, -1)


def scatter_blocks(buffer: Any, block_ids: Sequence[int], rows: np.ndarray) -> None:
    """Write `gather_blocks`' rows back into a pool buffer's blocks."""
    n = len(block_ids)
    shape = (n, *buffer.shape[:2], *buffer.shape[3:])  # [n, layers, 2, block_size, width]
    if hasattr(buffer, "data_ptr"):
        import torch

        values = torch.from_numpy(np.ascontiguousarray(rows)).to(buffer.device).view(buffer.dtype).reshape(shape)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=buffer.device)
        buffer.index_copy_(2, index, values.movedim(0, 2))
        return
    values = np.ascontiguousarray(rows).view(buffer.dtype).reshape(shape)
    buffer[:, :, list(block_ids)] = np.moveaxis(values, 0, 2)

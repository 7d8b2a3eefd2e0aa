"""The host tier: a bounded LRU of block payloads in this process's memory, keyed by the prefix cache's hashes."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.usage_bytes = 0
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # the engine thread looks up, the copy thread puts and gets

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: bytes) -> np.ndarray | None:
        with self._lock:
            payload = self._blocks.get(block_hash)
            if payload is not None:
                self._blocks.move_to_end(block_hash)
            return payload

    def put(self, block_hash: bytes, payload: np.ndarray) -> list[tuple[bytes, np.ndarray]]:
        """Keep the payload (a block too large for the tier is not kept); returns what was evicted for it,
        least recently used first (for the tier below)."""
        if payload.nbytes > self.capacity_bytes:
            return [(block_hash, payload)]
        evicted = []
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return []
            while self.usage_bytes + payload.nbytes > self.capacity_bytes:
                old_hash, old = self._blocks.popitem(last=False)
                self.usage_bytes -= old.nbytes
                evicted.append((old_hash, old))
            self._blocks[block_hash] = payload
            self.usage_bytes += payload.nbytes
        return evicted

    def items(self) -> list[tuple[bytes, np.ndarray]]:
        """Every kept block, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._blocks.items())

"""Prefill side of disaggregation: a handed-off request's KV blocks, pinned until a decode worker has read them.

A pin is one more reference on each block (BlockPool.touch), so the request can finish as usual (its own
references freed) while the blocks stay out of the free queue: nothing else can be written into them, and
full blocks stay in the prefix cache for later prompts. A pin ends when the decode worker's read completes
(NIXL notifies this worker with the handle id), when a decode worker says it will not read, or at its
deadline: a decode worker that died, a client that left, or a gateway that never sent the handle on must
not hold blocks forever. A decode worker refuses to start a read that could end after the deadline
(engine_format/kv_handle.py `expires_at`), so an expired pin is never read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.engine.block_pool import BlockPool


@dataclass(frozen=True)
class Pin:
    block_ids: tuple[int, ...]
    deadline: float  # the clock's


class KVPins:
    """Pinned blocks by handle id; callers hold the engine's lock (the pool is the engine's)."""

    def __init__(self, pool: BlockPool, timeout_s: float, clock: Callable[[], float]) -> None:
        self.pool, self.timeout_s, self.clock = pool, timeout_s, clock
        self._pins: dict[str, Pin] = {}
        self.released = 0  # pins ended by their reader
        self.expired = 0  # pins ended by their deadline

    def pin(self, handle_id: str, block_ids: list[int]) -> float:
        """Take a reference on `block_ids` for `handle_id`; returns the clock's deadline."""
        if handle_id in self._pins:
            raise ValueError(f"handle {handle_id!r} is pinned already")
        self.pool.touch(self.pool.blocks[b] for b in block_ids)
        pin = Pin(tuple(block_ids), self.clock() + self.timeout_s)
        self._pins[handle_id] = pin
        return pin.deadline

    def release(self, handle_id: str) -> bool:
        """End a pin (its reader is done); False if there is none (released or expired already)."""
        pin = self._pins.pop(handle_id, None)
        if pin is None:
            return False
        self._unpin(pin)
        self.released += 1
        return True

    def expire(self) -> int:
        """End the pins past their deadline; how many."""
        now = self.clock()
        late = [h for h, pin in self._pins.items() if pin.deadline <= now]
        for handle_id in late:
            self._unpin(self._pins.pop(handle_id))
        self.expired += len(late)
        return len(late)

    @property
    def num_blocks(self) -> int:
        """Block references pinned (a block pinned for two handles counts twice)."""
        return sum(len(pin.block_ids) for pin in self._pins.values())

    def held(self) -> list[tuple[int, ...]]:
        """Each pin's blocks: references the pool's invariant check must account for."""
        return [pin.block_ids for pin in self._pins.values()]

    def _unpin(self, pin: Pin) -> None:
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(pin.block_ids))  # a prefix outlives its suffix

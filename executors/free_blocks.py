"""The free list of a KV pool: which blocks may be handed out, in the order they will be.

One type for every owner of a pool's block ids: the engine's BlockPool (runtime/engine/block_pool.py:
reference counts and the prefix cache on top of this queue) and the greedy runner (executors/
greedy_runner.py: greedy_generate and the draft proposer). It knows nothing of what a block holds;
the order is the owner's policy, chosen per give-back:

- `append`: reused last. BlockPool's LRU order: a freed block that the prefix cache still indexes
  survives as long as possible before it is evicted.
- `prepend`: reused first, in the order given. The greedy runner's stack order (the freshly freed
  blocks, still in the CPU caches, go to the next sequence; ids stay low), which also keeps the block
  tables it hands the backend exactly what they were before this type existed.

`remove` takes one block out of the middle (a prefix-cache hit on a cached, unreferenced block).
Every operation is O(1) per block (an insertion-ordered dict).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence


class NoFreeBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for."""


class FreeBlockQueue:
    def __init__(self, block_ids: Iterable[int]) -> None:
        """`block_ids`: the free blocks, in the order they are handed out."""
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[int]:
        """The free blocks from the next handed out to the last."""
        return iter(self._queue)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._queue

    def take(self, count: int) -> list[int]:
        """The next `count` blocks, out of the queue; NoFreeBlocks (nothing taken) when fewer are free."""
        if count > len(self._queue):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._queue)} free")
        return [self._queue.popitem(last=False)[0] for _ in range(count)]

    def append(self, block_ids: Iterable[int]) -> None:
        """Give blocks back at the end, in order: they are reused after every block free now."""
        for block_id in block_ids:
            self._put(block_id)

    def prepend(self, block_ids: Sequence[int]) -> None:
        """Give blocks back at the front, in order: block_ids[0] is the next one taken."""
        for block_id in reversed(block_ids):
            self._put(block_id)
            self._queue.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        """Take one block out wherever it is (KeyError when it is not free)."""
        del self._queue[block_id]

    def _put(self, block_id: int) -> None:
        if block_id in self._queue:
            raise ValueError(f"block {block_id} given back twice")
        self._queue[block_id] = None

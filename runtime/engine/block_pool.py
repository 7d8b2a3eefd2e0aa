"""The KV block pool: reference counts, the prefix-cache index and the LRU free queue.

The free queue is executors/free_blocks.py's FreeBlockQueue, the free-list type every pool owner uses;
this pool gives blocks back at its end (`append`), so that the queue is in eviction order.

Invariants (checked by `check_invariants`, called by the tests):
- every block is exactly one of: used (ref_cnt > 0), cached (ref_cnt == 0, has a hash,
  evictable), free (ref_cnt == 0, no hash): free + cached + used == total, where free and
  cached are counted from the free queue and used from the reference counts;
- the free queue holds exactly the blocks with ref_cnt == 0 (free and cached alike), in
  eviction order: least recently freed first;
- the hash index maps each hash to one block carrying that hash, and every hashed block
  is in the index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from executors.free_blocks import FreeBlockQueue


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Taken from the front, given back at the end: the least recently freed block goes first.
        self._free = FreeBlockQueue(range(num_blocks))
        self._by_hash: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free plus evictable cached)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the front of the free queue, evicting cached ones (executors' NoFreeBlocks,
        nothing taken, when fewer are free)."""
        taken = []
        for block_id in self._free.take(count):
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict from the prefix cache
                del self._by_hash[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._by_hash.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (a cached block leaves the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks in the order they should be evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free.append([block.block_id])

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Index a full block whose K/V are written. If an identical block is already
        indexed (two requests computed the same prefix at once) the first one is kept."""
        if block.block_hash is None and block_hash not in self._by_hash:
            block.block_hash = block_hash
            self._by_hash[block_hash] = block

    def _categories(self) -> tuple[list[int], list[int], list[int]]:
        """(free, cached, used) block ids, each read from its own structure: free and cached
        from the free queue (without / with a hash), used from the reference counts."""
        free = [i for i in self._free if self.blocks[i].block_hash is None]
        cached = [i for i in self._free if self.blocks[i].block_hash is not None]
        used = [b.block_id for b in self.blocks if b.ref_cnt > 0]
        return free, cached, used

    def counts(self) -> dict[str, int]:
        free, cached, used = self._categories()
        return {"free": len(free), "cached": len(cached), "used": len(used)}

    def check_invariants(self) -> None:
        bad = [b.block_id for b in self.blocks if b.ref_cnt < 0]
        assert not bad, f"negative ref_cnt: blocks {bad}"
        bogus = [i for i in self._free if not (isinstance(i, int) and 0 <= i < self.num_blocks)]
        assert not bogus, f"free queue holds unknown block ids {bogus}"
        free, cached, used = self._categories()
        # Exactly one category per block: none counted twice, none missing, so the counts sum
        # to the total (each is counted from its own structure, so the sum can be wrong).
        seen = Counter(free + cached + used)
        doubled = sorted(i for i, n in seen.items() if n > 1)
        assert not doubled, f"blocks in more than one category: {doubled}"
        missing = sorted(set(range(self.num_blocks)) - seen.keys())
        assert not missing, f"blocks in no category: {missing}"
        assert len(free) + len(cached) + len(used) == self.num_blocks, self.counts()
        unreferenced = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(self._free) == unreferenced, "free queue != blocks with ref_cnt 0"
        stale = [h.hex() for h, b in self._by_hash.items() if b.block_hash != h]
        assert not stale, f"hash index entries for blocks not carrying that hash: {stale}"
        unindexed = [
            b.block_id for b in self.blocks if b.block_hash is not None and self._by_hash.get(b.block_hash) is not b
        ]
        assert not unindexed, f"hashed blocks missing from the hash index: {unindexed}"

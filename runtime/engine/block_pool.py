"""The KV block pool: reference counts, the prefix-cache index and the LRU free queue.

Invariants (checked by `check_invariants`, called by the tests):
- every block is exactly one of: used (ref_cnt > 0), cached (ref_cnt == 0, has a hash,
  evictable), free (ref_cnt == 0, no hash): free + cached + used == total;
- the free queue holds exactly the blocks with ref_cnt == 0 (free and cached alike), in
  eviction order: least recently freed first;
- the hash index maps each hash to one block carrying that hash, and every hashed block
  is in the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion-ordered: popping from the front takes the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free plus evictable cached)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the front of the free queue, evicting cached ones."""
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free")
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
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
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks in the order they should be evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Index a full block whose K/V are written. If an identical block is already
        indexed (two requests computed the same prefix at once) the first one is kept."""
        if block.block_hash is None and block_hash not in self._by_hash:
            block.block_hash = block_hash
            self._by_hash[block_hash] = block

    def counts(self) -> dict[str, int]:
        used = sum(b.ref_cnt > 0 for b in self.blocks)
        cached = sum(b.ref_cnt == 0 and b.block_hash is not None for b in self.blocks)
        return {"free": self.num_blocks - used - cached, "cached": cached, "used": used}

    def check_invariants(self) -> None:
        c = self.counts()
        assert c["free"] + c["cached"] + c["used"] == self.num_blocks, c
        assert set(self._free) == {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        hashed = {b.block_hash: b for b in self.blocks if b.block_hash is not None}
        assert hashed.keys() == self._by_hash.keys()
        assert all(self._by_hash[h] is b for h, b in hashed.items())

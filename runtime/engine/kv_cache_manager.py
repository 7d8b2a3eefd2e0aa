"""Per-request KV blocks on top of the pool: allocation on demand and prefix caching.

Prefix caching hashes each *full* block of a request's tokens, chained through the
previous block's hash, so equal hashes mean equal whole prefixes. The chain starts from the
request's cache salt (one per tenant): requests with different salts never share a block, so
one tenant cannot probe another's prompts through time-to-first-token. A block is indexed only
after its K/V have been written (`cache_computed_blocks`, called after each engine step,
for accepted tokens only: speculative drafts are not in a request's tokens until accepted): the
backend writes a step's K/V after the graph ran, so a block indexed earlier could be
read by another sequence of the same step before it holds data.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine_format import ceil_div
from runtime.engine.block_pool import BlockPool, KVBlock
from runtime.engine.request import Request

if TYPE_CHECKING:
    from runtime.engine.kv_tiers import KVTiers

log = logging.getLogger(__name__)


def salt_root(cache_salt: str | None, lora_id: str | None = None) -> bytes:
    """The parent hash of a request's first block: empty (shared) without a salt or a LoRA adapter; a prefix
    computed under one adapter (its content digest) is never another's, nor the base model's."""
    if cache_salt is None and lora_id is None:
        return b""
    key = (cache_salt or "").encode() + (b"" if lora_id is None else b"\0lora\0" + lora_id.encode())
    return hashlib.blake2b(key, digest_size=16, person=b"trtserve-salt").digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    data = parent + np.asarray(tokens, np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache
        self.tiers: KVTiers | None = None  # host and disk tiers behind the pool (kv_tiers/), set by the engine
        self._newly_cached: list[tuple[KVBlock, bytes]] = []  # indexed since the last `sync_tiers`: to store

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained hashes of its first `num_blocks` full blocks (memoized)."""
        tokens, bs, hashes = request.all_token_ids, self.block_size, request.block_hashes
        root = salt_root(request.params.cache_salt, request.lora_id)
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else root, tokens[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest cached prefix of full blocks, capped so at least one token is computed
        (the last token's logits are needed to sample); none for a request scoring its prompt (cached blocks
        come without the logits of their positions)."""
        if not self.enable_prefix_caching or request.scores_prompt:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in self._hashes(request, max_blocks):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def loading_from_tiers(self, request: Request, hits: Sequence[KVBlock]) -> bool:
        """True while the request's next blocks after its pool `hits` are being read back from a tier: it is
        admitted once they are in the pool (as hits). Starts that read when a tier holds them and the pool can
        spare the blocks; False (compute them) otherwise."""
        tiers = self.tiers
        if tiers is None or not self.enable_prefix_caching or request.scores_prompt:
            return False
        load = tiers.load_state(request.request_id)
        if load is not None:
            return not load.done
        wanted = self._hashes(request, (request.num_tokens - 1) // self.block_size)[len(hits) :]
        found = tiers.find(wanted)
        reusable = sum(b.ref_cnt == 0 for b in hits)
        if found == 0 or found + 1 > self.pool.num_free_blocks - reusable:  # + 1: the request's own next block
            return False
        self.pool.touch(hits)  # held while blocks are taken: evicting the request's own hits would waste the load
        blocks = self.pool.get_new_blocks(found)
        self.pool.free_blocks(reversed(hits))
        tiers.start_load(request.request_id, blocks, list(wanted[:found]))
        return True

    def sync_tiers(self, settle: bool = False) -> None:
        """Once a step, before scheduling: apply finished copies, and queue the blocks indexed since the last
        call for the tiers. `settle`: and wait for every copy (with no step running: tests, the shutdown)."""
        if self.tiers is not None:
            self.tiers.poll()
            cached, self._newly_cached = self._newly_cached, []
            self.tiers.store(cached)
            if settle:
                self.tiers.settle()

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup (not the retries of a blocked one)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after its computed
        prefix and any `computed_blocks` hits). Returns False, changing nothing, if the pool
        cannot supply them."""
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        held = len(request.block_ids) + len(computed_blocks)
        need = self.blocks_for(num_tokens) - held
        # Hits sitting in the free queue stop being allocatable once touched.
        reusable = sum(b.ref_cnt == 0 for b in computed_blocks)
        if need > self.pool.num_free_blocks - reusable:
            return False
        self.pool.touch(computed_blocks)
        new = [b.block_id for b in computed_blocks]
        request.num_cached_blocks += len(computed_blocks)
        if need > 0:
            new += [b.block_id for b in self.pool.get_new_blocks(need)]
        if new:  # a new list, never the old one grown: a step's chunks hold the old one (step_inputs.py)
            request.block_ids = request.block_ids + new
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose K/V are now in the pool."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            block = self.pool.blocks[request.block_ids[i]]
            self.pool.cache_block(block, hashes[i])
            if self.tiers is not None and block.block_hash is hashes[i]:  # newly indexed here
                self._newly_cached.append((block, hashes[i]))
        request.num_cached_blocks = num_full

    def trim(self, request: Request) -> None:
        """Speculative rollback: return the blocks past the request's tokens (they held only
        rejected drafts), tail first. Never a hashed block: only computed full blocks are hashed."""
        keep = self.blocks_for(request.num_tokens)
        if len(request.block_ids) > keep:
            self.pool.free_blocks(self.pool.blocks[b] for b in reversed(request.block_ids[keep:]))
            request.block_ids = request.block_ids[:keep]  # a new list: a step's chunks hold the old one

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so a prefix outlives its suffix."""
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0
        if self.tiers is not None:  # a request that leaves while blocks are read back for it from a tier
            self.tiers.release(request.request_id)

    def admitted(self, request: Request) -> None:
        """The request holds its prefix hits now: blocks read back for it from a tier are no longer held."""
        if self.tiers is not None:
            self.tiers.release(request.request_id)

    def close_tiers(self) -> None:
        """Stop the tiers' copies and write what the disk tier lacks (the pool's indexed blocks included)."""
        if self.tiers is not None:
            self.sync_tiers(settle=True)
            cached = [(b.block_id, b.block_hash) for b in self.pool.blocks if b.block_hash is not None]
            self.tiers.close(cached)
            self.tiers = None

    def check_invariants(self, live_requests: Sequence[Request] | None = None,
                         held: Sequence[Sequence[int]] = ()) -> None:  # fmt: skip
        """Pool invariants; with every live request given, also that the block tables (and `held`: references
        taken outside requests, runtime/engine/disagg.py's pins and staged pulls, the tiers' copies) account for
        every reference."""
        self.pool.check_invariants()
        held = [*held, *(self.tiers.held() if self.tiers is not None else [])]
        if live_requests is not None:
            refs = np.zeros(self.pool.num_blocks, np.int64)
            for block_ids in [*(r.block_ids for r in live_requests), *held]:
                np.add.at(refs, list(block_ids), 1)
            assert refs.tolist() == [b.ref_cnt for b in self.pool.blocks], "ref counts != block tables"

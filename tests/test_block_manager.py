"""Exact block ids of the block pool, KV cache manager and prefix cache (no model needed)."""

from __future__ import annotations

import pytest

from executors.sampling import SamplingParams, SamplingState
from runtime.engine.errors import InvalidRequest
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.request import Request

BS = 4


def make_request(tokens: list[int], order: int = 0, max_tokens: int = 8, cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, cache_salt=cache_salt)
    return Request(str(order), list(tokens), params, SamplingState(params, tokens, 100), arrival_order=order)


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does for a waiting request; returns the hit tokens."""
    hits = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - len(hits) * BS, hits)
    kv.record_lookup(request.num_tokens, len(hits) * BS)
    request.num_computed_tokens = request.num_tokens  # pretend the step ran
    kv.cache_computed_blocks(request)
    return len(hits) * BS


def test_allocation_on_demand_and_free_in_reverse():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request(list(range(10)))  # 10 tokens -> 3 blocks
    assert admit(kv, a) == 0
    assert a.block_ids == [0, 1, 2]
    # Decode: token 11 fits in block 2; token 13 needs a new block.
    a.all_token_ids += [50, 51]
    assert kv.allocate_slots(a, 2) and a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 12
    a.append_output_token(52)
    assert kv.allocate_slots(a, 1) and a.block_ids == [0, 1, 2, 3]
    kv.free(a)
    kv.check_invariants([])
    # Freed tail first: the next allocation takes never-used blocks, then 3, 2, 1, 0.
    b = make_request(list(range(90, 99)) * 4)  # 36 tokens -> 9 blocks, no common prefix
    assert admit(kv, b) == 0
    assert b.block_ids == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_prefix_hit_shares_blocks_and_is_capped():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_request(list(range(12)), order=0)  # exactly 3 full blocks
    admit(kv, a)
    assert a.block_ids == [0, 1, 2] and a.num_cached_blocks == 3
    # Same 12 tokens: only 2 blocks may hit (at least one token must be computed).
    b = make_request(list(range(12)), order=1)
    assert admit(kv, b) == 8
    assert b.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # Diverging in block 1: only block 0 hits.
    c = make_request([0, 1, 2, 3, 4, 99, 6, 7, 8], order=2)
    assert admit(kv, c) == 4
    assert c.block_ids == [0, 4, 5]
    kv.check_invariants([a, b, c])
    assert kv.prefix_queries == 12 + 12 + 9 and kv.prefix_hits == 8 + 4


def test_cache_salt_isolates_tenants_prefixes():
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    prompt = list(range(12))
    a = make_request(prompt, order=0, cache_salt="tenant-a")
    admit(kv, a)
    assert a.block_ids == [0, 1, 2]
    # Another tenant with the same prompt: no hit, fresh blocks; nor does an unsalted request hit.
    b = make_request(prompt, order=1, cache_salt="tenant-b")
    assert admit(kv, b) == 0 and b.block_ids == [3, 4, 5]
    c = make_request(prompt, order=2)
    assert admit(kv, c) == 0 and c.block_ids == [6, 7, 8]
    # The same tenant hits its own blocks (capped to leave one token to compute).
    d = make_request(prompt, order=3, cache_salt="tenant-a")
    assert admit(kv, d) == 8 and d.block_ids == [0, 1, 9]
    kv.check_invariants([a, b, c, d])


def test_cache_salt_is_validated():
    with pytest.raises(InvalidRequest, match="cache_salt"):
        SamplingParams(cache_salt="")
    with pytest.raises(InvalidRequest, match="cache_salt"):
        SamplingParams(cache_salt="x" * 257)


def test_freed_cached_blocks_are_reused_lru_and_evicted_last():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request(list(range(8)), order=0)  # blocks 0, 1 (both full, cached)
    admit(kv, a)
    kv.free(a)
    assert kv.pool.counts() == {"free": 4, "cached": 2, "used": 0}
    # A hit on a freed cached block revives it without allocating.
    b = make_request([*range(8), 42], order=1)
    assert admit(kv, b) == 8 and b.block_ids == [0, 1, 2]
    kv.free(b)
    # Eviction order: never-used blocks first, then freed ones, tail of a sequence first.
    c = make_request(list(range(50, 74)), order=2)  # 24 tokens -> 6 blocks: must evict 0 and 1
    assert admit(kv, c) == 0
    assert c.block_ids == [3, 4, 5, 2, 1, 0]
    assert kv.pool.lookup(b.block_hashes[0]) is None  # evicted from the index
    kv.check_invariants([c])


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(12)), order=0)
    admit(kv, a)
    b = make_request(list(range(50, 58)), order=1)
    before = kv.pool.counts()
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.pool.counts() == before
    kv.check_invariants([a, b])


def test_hit_on_free_block_counts_against_availability():
    """A cached hit sitting in the free queue cannot also be handed out as a new block."""
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request(list(range(8)), order=0)
    admit(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free; block 2 free
    b = make_request(list(range(8)) + list(range(100, 108)), order=1)  # 4 blocks > 3: cannot fit
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert not kv.allocate_slots(b, 8, hits)
    kv.check_invariants([])


def test_no_prefix_caching_means_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a, b = make_request(list(range(12)), 0), make_request(list(range(12)), 1)
    admit(kv, a)
    assert admit(kv, b) == 0 and set(a.block_ids).isdisjoint(b.block_ids)
    assert kv.pool.counts()["cached"] == 0


def test_request_keeps_one_token_list():
    prompt = [5, 6, 7]
    r = make_request(prompt)
    r.append_output_token(8)
    r.append_output_token(9)
    assert prompt == [5, 6, 7]  # the caller's list is copied, never grown
    assert r.all_token_ids == [5, 6, 7, 8, 9] and r.num_prompt_tokens == 3
    assert r.prompt_token_ids == [5, 6, 7] and r.output_token_ids == [8, 9]
    assert (r.num_tokens, r.num_output_tokens, r.max_total_tokens) == (5, 2, 3 + 8)
    assert r.all_token_ids is r.all_token_ids  # an attribute, not rebuilt per access


def test_counts_are_read_from_the_structures():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request(list(range(10)))  # blocks 0, 1 full (cached once computed), 2 partial
    admit(kv, a)
    assert kv.pool.counts() == {"free": 3, "cached": 0, "used": 3}
    kv.free(a)
    assert kv.pool.counts() == {"free": 4, "cached": 2, "used": 0}
    kv.check_invariants([])


def pool_with_cached_and_used() -> tuple[KVCacheManager, Request]:
    """6 blocks: a holds 0, 1, 2 (0 and 1 cached); b's freed 3, 4 are cached; 5 is free."""
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request(list(range(10)), order=0)
    admit(kv, a)
    b = make_request(list(range(50, 58)), order=1)
    admit(kv, b)
    assert b.block_ids == [3, 4]
    kv.free(b)
    assert kv.pool.counts() == {"free": 1, "cached": 2, "used": 3}
    kv.check_invariants([a])
    return kv, a


def test_invariant_check_catches_a_leaked_reference():
    kv, a = pool_with_cached_and_used()
    kv.pool.blocks[a.block_ids[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref counts != block tables"):
        kv.check_invariants([a])


def test_invariant_check_catches_a_free_block_dropped_from_the_free_queue():
    kv, a = pool_with_cached_and_used()
    kv.pool._free.remove(5)  # ref_cnt 0, yet neither free nor cached: lost forever
    assert kv.pool.counts() == {"free": 0, "cached": 2, "used": 3}  # sums to 5, not 6
    with pytest.raises(AssertionError, match=r"blocks in no category: \[5\]"):
        kv.check_invariants([a])


def test_invariant_check_catches_a_cached_block_dropped_from_the_free_queue():
    kv, a = pool_with_cached_and_used()
    kv.pool._free.remove(3)
    with pytest.raises(AssertionError, match=r"blocks in no category: \[3\]"):
        kv.check_invariants([a])


def test_invariant_check_catches_a_used_block_in_the_free_queue():
    kv, a = pool_with_cached_and_used()
    kv.pool._free.append([a.block_ids[2]])  # block 2 could be handed out while a writes it
    assert kv.pool.counts() == {"free": 2, "cached": 2, "used": 3}  # sums to 7, not 6
    with pytest.raises(AssertionError, match=r"blocks in more than one category: \[2\]"):
        kv.check_invariants([a])


def test_invariant_check_catches_a_stale_hash_index_entry():
    kv, a = pool_with_cached_and_used()
    block = kv.pool.blocks[3]  # cached: its hash dropped without leaving the index
    stale_hash, block.block_hash = block.block_hash, None
    assert kv.pool.counts() == {"free": 2, "cached": 1, "used": 3}  # the counts alone look fine
    # A lookup would still hit block 3, which may be rewritten at any time as a free block.
    assert kv.pool.lookup(stale_hash) is block
    with pytest.raises(AssertionError, match="hash index entries for blocks not carrying that hash"):
        kv.check_invariants([a])


def test_invariant_check_catches_a_hashed_block_missing_from_the_index():
    kv, a = pool_with_cached_and_used()
    del kv.pool._by_hash[kv.pool.blocks[1].block_hash]
    with pytest.raises(AssertionError, match=r"hashed blocks missing from the hash index: \[1\]"):
        kv.check_invariants([a])


def test_invariant_check_catches_a_negative_ref_cnt():
    kv, a = pool_with_cached_and_used()
    kv.pool.blocks[5].ref_cnt = -1
    with pytest.raises(AssertionError, match=r"negative ref_cnt: blocks \[5\]"):
        kv.check_invariants([a])

"""The scheduler over a real KV cache manager, with fake requests and no model.

A tiny driver stands in for the engine's postprocess: each scheduled request's computed
tokens advance by what was scheduled, its full blocks are indexed in the prefix cache, and a
request that has computed all its tokens gets one sampled token; at max_tokens it finishes.
Every test asserts exact token counts per request per step and exact block ids.

Step costs come from a fake cost model with round numbers (FAKE_COST, "ms"): the time-target
tests (test_scheduler_slo.py) check chunk sizes against it exactly; arrivals are stamped from
the Sim's own `now`, so TTFT deadlines are exact too.
"""

from __future__ import annotations

import itertools

import pytest

from executors.sampling import SamplingParams, SamplingState
from runtime.engine.errors import Overloaded
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.request import Request, RequestStatus, RequestTiming
from runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from runtime.engine.step_cost import StepCost, StepShape

BS = 4  # tokens per block
SAMPLED = 7  # the token every fake "sample" appends
# A step costs 10 + 1 per prefill token + 5 per decode ("ms"; attention free unless a test says).
FAKE_COST = StepCost(base_s=10, prefill_token_s=1, decode_seq_s=5, kilo_pair_s=0)


class Sim:
    """A Scheduler over `num_blocks` KV blocks, driven like the engine drives it."""

    def __init__(
        self,
        num_blocks: int,
        budget: int = 64,
        max_num_seqs: int = 8,
        max_waiting: int = 64,
        prefix_caching: bool = True,
        itl_target: float | None = None,
        min_prefill: int = 4,
        cost: StepCost = FAKE_COST,
    ):
        self.kv = KVCacheManager(num_blocks, BS, prefix_caching)
        config = SchedulerConfig(max_num_seqs, budget, max_waiting, itl_target, min_prefill)
        self.cost = cost
        self.scheduler = Scheduler(config, self.kv, cost)
        self.arrivals = itertools.count()
        self.now = 0.0  # arrival stamp of the next request
        self.requests: dict[str, Request] = {}
        self.preempted: list[list[str]] = []  # per step, in preemption order
        self.batches: list[ScheduledBatch] = []
        self.costs: list[float] = []  # per step: the fake cost of what was scheduled
        self.accept: dict[str, int] = {}  # speculative drafts each request's verify accepts (default 0)

    def add(self, request_id: str, prompt_len: int = 0, max_tokens: int = 4, priority: int = 0, tokens=None,
            ttft_target: float | None = None, itl_target: float | None = None,
            bounded: bool = True) -> Request:  # fmt: skip
        """A request whose prompt is `tokens`, or `prompt_len` tokens unique to it."""
        order = next(self.arrivals)
        tokens = list(tokens) if tokens is not None else [1000 * (order + 1) + i for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, priority=priority,
                                ttft_target_s=ttft_target, itl_target_s=itl_target)  # fmt: skip
        request = Request(request_id, tokens, params, SamplingState(params, tokens, 100_000), arrival_order=order,
                          timing=RequestTiming(arrival=self.now))  # fmt: skip
        self.scheduler.add(request, bounded)
        self.requests[request_id] = request
        return request

    def step(self) -> dict[str, int]:
        """One engine step; returns {request id: tokens scheduled} in scheduling order."""
        batch = self.scheduler.schedule()
        config = self.scheduler.config
        assert batch.budget == config.max_num_batched_tokens - sum(batch.num_tokens.values()) >= 0
        assert len(batch.num_tokens) <= config.max_num_seqs
        self.preempted.append([r.request_id for r in batch.preempted])
        self.batches.append(batch)
        shape = StepShape.of((n, r.num_computed_tokens) for r, n in batch.num_tokens.items())
        self.costs.append(self.cost.predict(shape))
        assert batch.predicted_s == self.costs[-1] or batch.preempted  # the scheduler's own estimate
        assert batch.shape == shape or batch.preempted  # what the engine's cost model observes
        for request, n in batch.num_tokens.items():
            drafts = request.draft_token_ids[: max(0, n - request.num_tokens_to_compute)]
            assert len(drafts) == len(request.draft_token_ids)  # the scheduler trims drafts to what it took
            if drafts:  # a verify: self.accept[id] of the drafts are accepted, then one token is sampled
                accepted = drafts[: self.accept.get(request.request_id, 0)]
                request.num_computed_tokens = request.num_tokens + len(accepted)
                request.all_token_ids += accepted
                request.draft_token_ids = []
            else:
                request.num_computed_tokens += n
            self.kv.cache_computed_blocks(request)
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token(SAMPLED)
                self.kv.trim(request)  # a verify's blocks that held only rejected drafts
                if request.num_output_tokens >= request.params.max_tokens:
                    self.scheduler.remove(request)
                    request.status = RequestStatus.FINISHED
                    del self.requests[request.request_id]
        self.kv.check_invariants(list(self.requests.values()))
        return {r.request_id: n for r, n in batch.num_tokens.items()}

    def run(self, steps: int) -> list[dict[str, int]]:
        return [self.step() for _ in range(steps)]

    def blocks(self, request_id: str) -> list[int]:
        return self.requests[request_id].block_ids

    @property
    def running(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    @property
    def waiting(self) -> list[str]:
        """The waiting queue in the order it will be admitted."""
        return [r.request_id for _, r in sorted(self.scheduler.waiting, key=lambda kr: kr[0])]

    def drain(self) -> None:
        for _ in range(1000):
            if not self.requests:
                break
            self.step()
        assert not self.requests and not self.scheduler.running and not self.scheduler.waiting
        assert self.kv.pool.counts()["used"] == 0


def test_one_request_prefill_in_chunks_then_decode():
    sim = Sim(num_blocks=16, budget=10)
    sim.add("a", prompt_len=25, max_tokens=3)
    assert sim.step() == {"a": 10}
    assert sim.blocks("a") == [0, 1, 2]  # 10 tokens -> 3 blocks, allocated on demand
    assert sim.step() == {"a": 10}
    assert sim.blocks("a") == [0, 1, 2, 3, 4]
    assert sim.step() == {"a": 5}  # the last chunk: 25 - 20; samples the first token
    assert sim.blocks("a") == [0, 1, 2, 3, 4, 5, 6]
    assert sim.requests["a"].output_token_ids == [SAMPLED]
    assert sim.run(2) == [{"a": 1}, {"a": 1}]  # 2 decodes -> 3 tokens: finished
    assert not sim.requests and sim.step() == {}
    # 27 tokens were computed (the last sampled one never is): 6 full blocks stay cached.
    assert sim.kv.pool.counts() == {"free": 10, "cached": 6, "used": 0}


def test_chunk_sizes_are_what_decodes_leave_of_the_budget():
    sim = Sim(num_blocks=16, budget=16)
    sim.add("d", prompt_len=2, max_tokens=10)
    sim.add("a", prompt_len=40, max_tokens=3)
    assert sim.step() == {"d": 2, "a": 14}  # 16 - 2
    assert sim.blocks("d") == [0] and sim.blocks("a") == [1, 2, 3, 4]
    assert list(sim.step().items()) == [("d", 1), ("a", 15)]  # the decode first, then 16 - 1
    assert sim.blocks("a") == [1, 2, 3, 4, 5, 6, 7, 8]  # 29 tokens
    assert list(sim.step().items()) == [("d", 1), ("a", 11)]  # the remainder: 40 - 29
    assert sim.blocks("a") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # Both decode now, in FCFS order; each needs a new block, taken in that order.
    assert list(sim.step().items()) == [("d", 1), ("a", 1)]
    assert sim.blocks("d") == [0, 11] and sim.blocks("a") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]
    sim.drain()


def test_decodes_run_before_a_higher_priority_prefill_and_newcomers_get_the_rest():
    sim = Sim(num_blocks=16, budget=8)
    sim.add("low", prompt_len=6, max_tokens=8, priority=5)
    assert sim.step() == {"low": 6}
    sim.add("high", prompt_len=20, max_tokens=2, priority=0)
    assert list(sim.step().items()) == [("low", 1), ("high", 7)]
    sim.add("new", prompt_len=5, max_tokens=2, priority=0)
    # The decode of the low-priority request still comes first; the running prefill takes
    # the rest of the budget, so the newcomer waits even though it has a higher priority.
    assert list(sim.step().items()) == [("low", 1), ("high", 7)]
    assert sim.waiting == ["new"]
    assert list(sim.step().items()) == [("low", 1), ("high", 6), ("new", 1)]
    assert sim.requests["high"].num_computed_tokens == 20
    # Two decodes now, in priority order, then new's prefill.
    assert list(sim.step().items()) == [("high", 1), ("low", 1), ("new", 4)]
    sim.drain()


def test_max_num_seqs_caps_the_running_set():
    sim = Sim(num_blocks=16, max_num_seqs=2)
    for name in "abc":
        sim.add(name, prompt_len=3, max_tokens=2)
    assert sim.step() == {"a": 3, "b": 3}
    assert sim.running == ["a", "b"] and sim.waiting == ["c"]
    assert sim.step() == {"a": 1, "b": 1}  # both finish (2 tokens each)
    assert sim.step() == {"c": 3}
    assert sim.blocks("c") == [2]  # freed blocks 0 and 1 went to the back of the free queue
    sim.drain()


def test_priority_classes_then_fcfs():
    sim = Sim(num_blocks=16, max_num_seqs=1)
    sim.add("p0-first", prompt_len=3, max_tokens=1, priority=0)
    sim.add("p1", prompt_len=3, max_tokens=1, priority=1)
    sim.add("p0-second", prompt_len=3, max_tokens=1, priority=0)
    sim.add("urgent", prompt_len=3, max_tokens=1, priority=-1)
    assert sim.waiting == ["urgent", "p0-first", "p0-second", "p1"]
    assert sim.run(5) == [{"urgent": 3}, {"p0-first": 3}, {"p0-second": 3}, {"p1": 3}, {}]


def test_head_of_line_blocking():
    sim = Sim(num_blocks=4)
    sim.add("a", prompt_len=8, max_tokens=3)  # 10 tokens at most: 3 blocks
    assert sim.step() == {"a": 8} and sim.blocks("a") == [0, 1]
    sim.add("big", prompt_len=11, max_tokens=2)  # 3 blocks; after a's decode, 1 is free
    sim.add("small", prompt_len=3, max_tokens=2)  # 1 block would fit, but must not overtake
    assert sim.step() == {"a": 1}
    assert sim.waiting == ["big", "small"]
    assert sim.step() == {"a": 1}  # a finishes; its blocks go to the free queue, tail first
    assert sim.step() == {"big": 11, "small": 3}
    assert sim.blocks("big") == [3, 2, 1] and sim.blocks("small") == [0]


def test_preemption_frees_the_latest_arrival_and_requeues_it_first():
    sim = Sim(num_blocks=4, prefix_caching=False)
    sim.add("a", prompt_len=7, max_tokens=6)  # 13 tokens at most: the whole pool
    sim.add("b", prompt_len=7, max_tokens=6)
    assert sim.step() == {"a": 7, "b": 7}
    assert sim.blocks("a") == [0, 1] and sim.blocks("b") == [2, 3]
    assert sim.step() == {"a": 1, "b": 1}  # token 8 still fits in the second block
    sim.add("c", prompt_len=3, max_tokens=2)  # arrives after b
    # a's 9th token needs a block and none is free: b (same priority, later) is the victim.
    # Nothing is admitted in a step that preempted.
    assert sim.step() == {"a": 1}
    assert sim.preempted[-1] == ["b"]
    b = sim.requests["b"]
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, [], 0, 1)
    assert sim.blocks("a") == [0, 1, 3]  # b freed 3 then 2; a took 3
    assert sim.waiting == ["b", "c"]  # its original arrival keeps b ahead of c
    # b needs 3 blocks to recompute its 9 tokens (7 prompt + 2 sampled); 1 is free. c,
    # which would fit, waits behind it.
    assert sim.run(3) == [{"a": 1}, {"a": 1}, {"a": 1}]
    assert "a" not in sim.requests and sim.preempted[-3:] == [[], [], []]
    assert sim.step() == {"b": 9, "c": 3}  # b recomputes everything (no prefix cache)
    assert sim.blocks("b") == [2, 3, 1] and sim.blocks("c") == [0]  # free queue: 2, then a's tail first
    assert sim.scheduler.num_preemptions == 1
    sim.drain()


def test_several_victims_lowest_priority_first_then_latest_arrival():
    sim = Sim(num_blocks=7, budget=12, prefix_caching=False)
    sim.add("b", prompt_len=3, max_tokens=6, priority=0)
    sim.add("c", prompt_len=3, max_tokens=6, priority=1)
    sim.add("d", prompt_len=3, max_tokens=6, priority=0)
    assert list(sim.step().items()) == [("b", 3), ("d", 3), ("c", 3)]
    assert (sim.blocks("b"), sim.blocks("d"), sim.blocks("c")) == ([0], [1], [2])
    sim.add("a", prompt_len=16, max_tokens=2, priority=-1)
    assert list(sim.step().items()) == [("b", 1), ("d", 1), ("c", 1), ("a", 9)]
    assert sim.blocks("a") == [3, 4, 5]
    # Each decode needs a second block; one is free. b takes it; d's allocation preempts c
    # (lowest priority); a's chunk of 7 then needs a 4th block and preempts d (same priority
    # as b, later arrival), whose decode was already scheduled this step and is undone.
    assert list(sim.step().items()) == [("b", 1), ("a", 7)]
    assert sim.preempted[-1] == ["c", "d"]
    assert sim.blocks("b") == [0, 6] and sim.blocks("a") == [3, 4, 5, 2]
    assert sim.waiting == ["d", "c"]  # priority first, then arrival
    sim.add("e", prompt_len=3, max_tokens=1, priority=0)
    assert sim.waiting == ["d", "e", "c"]
    assert [sim.requests[x].num_tokens for x in "dc"] == [5, 5]  # 3 prompt + 2 sampled each
    sim.drain()
    assert sim.scheduler.num_preemptions == 2


def test_a_preempted_request_resumes_from_its_cached_prefix():
    sim = Sim(num_blocks=4)
    sim.add("a", prompt_len=7, max_tokens=6)
    sim.add("b", prompt_len=7, max_tokens=6)
    assert sim.run(3) == [{"a": 7, "b": 7}, {"a": 1, "b": 1}, {"a": 1}]
    assert sim.preempted[-1] == ["b"]
    # b's first block (full, computed) was cached when freed: 2 then 3 went to the free
    # queue; a took 3; 2 still holds b's first 4 tokens.
    assert sim.blocks("a") == [0, 1, 3]
    assert sim.kv.pool.counts() == {"free": 0, "cached": 1, "used": 3}
    assert sim.run(3) == [{"a": 1}, {"a": 1}, {"a": 1}]
    # a finished; b's 9 tokens: block 2 hits, 5 are recomputed.
    assert sim.step() == {"b": 5}
    assert sim.blocks("b") == [2, 3, 1]


def test_prefix_hits_share_exact_blocks():
    sim = Sim(num_blocks=16)
    shared = list(range(100, 112))  # 3 full blocks
    sim.add("a", tokens=shared, max_tokens=4)
    sim.add("twin", tokens=shared, max_tokens=4)  # same step: a's blocks are not indexed yet
    assert sim.step() == {"a": 12, "twin": 12}
    assert sim.blocks("a") == [0, 1, 2] and sim.blocks("twin") == [3, 4, 5]
    # Now indexed (a's, computed first; the twin's identical blocks are not indexed).
    # Same prompt: 2 blocks hit (one token must be computed to sample).
    sim.add("same", tokens=shared, max_tokens=4)
    # Diverging in the third block: 2 blocks hit.
    sim.add("fork", tokens=[*shared[:8], 1, 2, 3, 4, 5], max_tokens=4)
    # Diverging in the first block: no hits.
    sim.add("other", tokens=[99, *shared[1:]], max_tokens=4)
    assert sim.step() == {"a": 1, "twin": 1, "same": 4, "fork": 5, "other": 12}
    assert sim.blocks("same") == [0, 1, 8]  # a and twin took 6 and 7 for their 13th token
    assert sim.blocks("fork") == [0, 1, 9, 10]
    assert sim.blocks("other") == [11, 12, 13]
    assert [sim.kv.pool.blocks[i].ref_cnt for i in range(3)] == [3, 3, 1]
    assert (sim.kv.prefix_queries, sim.kv.prefix_hits) == (12 + 12 + 12 + 13 + 12, 8 + 8)
    sim.drain()


def test_overload_rejects_new_requests_but_never_a_preempted_one():
    sim = Sim(num_blocks=2, max_waiting=1)
    sim.add("a", prompt_len=3, max_tokens=5)  # 8 tokens at most: both blocks
    assert sim.step() == {"a": 3}
    sim.add("b", prompt_len=3, max_tokens=5)
    with pytest.raises(Overloaded, match="overloaded: 1 requests already waiting"):
        sim.add("x", prompt_len=3)
    assert sim.waiting == ["b"]
    assert sim.step() == {"a": 1, "b": 3}
    sim.add("c", prompt_len=3, max_tokens=1)
    # a's 5th token needs a block: b is preempted and requeued past the bound, ahead of c.
    assert sim.step() == {"a": 1}
    assert sim.preempted[-1] == ["b"] and sim.waiting == ["b", "c"]
    with pytest.raises(Overloaded, match="overloaded: 2 requests already waiting"):
        sim.add("y", prompt_len=3)
    assert sim.waiting == ["b", "c"]
    # A request that must not be refused (a decode worker's, its KV already read) queues past the bound.
    sim.add("z", prompt_len=3, max_tokens=1, bounded=False)
    assert sim.waiting == ["b", "c", "z"]
    sim.drain()


def test_drafts_take_budget_and_slots_and_roll_back_to_exact_blocks():
    """Drafts ride on a decode (1 + drafts tokens) while the budget has room beyond every decode's own
    token; on rejection the blocks that held only rejected drafts go back, to the free queue's tail."""
    sim = Sim(num_blocks=16, budget=12)
    a, b = sim.add("a", prompt_len=3, max_tokens=20), sim.add("b", prompt_len=3, max_tokens=20)
    assert sim.step() == {"a": 3, "b": 3}
    assert sim.blocks("a") == [0] and sim.blocks("b") == [1]
    a.draft_token_ids, b.draft_token_ids = [11] * 9, [12, 13]
    sim.accept = {"a": 2}
    # a: 1 + 9 drafts (12 - 2 decodes leaves 10 spare); b: the 1 spare token left -> 1 draft.
    assert sim.step() == {"a": 10, "b": 2}
    # a computed positions 3..12 over blocks [0, 2, 3, 4]; 2 drafts accepted: 7 tokens keep 2 blocks.
    assert sim.blocks("a") == [0, 2] and sim.blocks("b") == [1, 5]
    assert a.output_token_ids == [SAMPLED, 11, 11, SAMPLED] and a.num_computed_tokens == 6
    assert b.output_token_ids == [SAMPLED, SAMPLED] and b.num_computed_tokens == 4
    assert sim.kv.pool.counts() == {"free": 12, "cached": 0, "used": 4}
    hashed = [sim.kv.pool.blocks[i].block_hash is not None for i in range(6)]
    assert hashed == [True, True, False, False, False, False]  # only full blocks of accepted tokens
    assert sim.step() == {"a": 1, "b": 1}
    a.draft_token_ids, sim.accept = [1] * 5, {"a": 5}  # positions 8..12: two new blocks, all accepted
    assert sim.step() == {"a": 6, "b": 1}
    assert sim.blocks("a") == [0, 2, 6, 7]  # from the front of the free queue: 3 and 4 were freed last
    assert a.num_computed_tokens == 13 and a.output_token_ids[-6:] == [1] * 5 + [SAMPLED]
    sim.drain()


def test_drafts_shrink_to_the_blocks_the_pool_spares():
    sim = Sim(num_blocks=4, budget=16)
    a, _ = sim.add("a", prompt_len=3, max_tokens=4), sim.add("b", prompt_len=3, max_tokens=4)
    assert sim.step() == {"a": 3, "b": 3}
    a.draft_token_ids = [5] * 9  # positions 4..12 would need 3 more blocks; 2 are free
    assert sim.step() == {"a": 9, "b": 1}  # 8 drafts: positions 3..11 fill blocks 0, 2 and 3
    assert sim.preempted[-1] == [] and a.draft_token_ids == [] and sim.blocks("a") == [0, 2]
    sim.drain()


def test_drafts_never_take_a_block_another_decode_needs():
    """a's drafts want the last free block, which b's own next token needs: a drafts nothing, nobody is preempted."""
    sim = Sim(num_blocks=3, budget=16)
    a, _ = sim.add("a", prompt_len=3, max_tokens=4), sim.add("b", prompt_len=4, max_tokens=4)
    assert sim.step() == {"a": 3, "b": 4}
    a.draft_token_ids = [5] * 4
    assert sim.step() == {"a": 1, "b": 1}
    assert sim.preempted[-1] == [] and a.draft_token_ids == [] and sim.blocks("b") == [1, 2]
    sim.drain()


def test_a_preempted_request_drops_its_drafts():
    sim = Sim(num_blocks=2, budget=16)
    sim.add("a", prompt_len=4, max_tokens=3)
    b = sim.add("b", prompt_len=4, max_tokens=3)
    assert sim.step() == {"a": 4, "b": 4}
    b.draft_token_ids = [1, 2]
    assert sim.step() == {"a": 1}  # a's 5th position needs a block: b (latest) is preempted
    assert sim.preempted[-1] == ["b"] and b.draft_token_ids == [] and b.block_ids == []
    sim.drain()


def test_the_prefix_cache_never_holds_a_rejected_draft():
    sim = Sim(num_blocks=16, budget=16)
    a = sim.add("a", prompt_len=3, max_tokens=8)
    sim.step()
    a.draft_token_ids = [70, 71, 72, 73, 74]  # positions 4..8: block 1 filled with drafts only
    assert sim.step() == {"a": 6}  # all rejected
    assert sim.blocks("a") == [0, 1] and a.num_computed_tokens == 4
    assert sim.kv.pool.blocks[1].block_hash is None  # its rows hold rejected drafts
    probe = Request("p", [*a.prompt_token_ids, SAMPLED, 70, 71, 72, 73, 99], a.params,
                    SamplingState(a.params, [1], 100_000), arrival_order=99)  # fmt: skip
    assert [blk.block_id for blk in sim.kv.get_computed_blocks(probe)] == [0]
    sim.drain()


def test_drafts_leave_pending_prompts_their_minimum_share():
    sim = Sim(num_blocks=32, budget=12, min_prefill=4)
    a = sim.add("a", prompt_len=3, max_tokens=20)
    sim.step()
    sim.add("c", prompt_len=20, max_tokens=2)
    a.draft_token_ids = [9] * 9
    assert sim.step() == {"a": 8, "c": 4}  # 12 - 1 decode - 4 for the waiting prompt = 7 drafts
    a.draft_token_ids = [9] * 9
    assert sim.step() == {"a": 8, "c": 4}  # c still prefilling: the same split
    sim.drain()

"""The scheduler: which requests run this step, and how many tokens each.

Per step, under a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`):
1. running requests in decode (one token each), highest priority first;
2. running requests still prefilling, one chunk each to fill the budget;
3. waiting requests (priority, then FCFS), with their prefix-cache hits, while the budget,
   the sequence cap and the pool allow. The queue head blocks the ones behind it (no
   overtaking), so a long prompt is not starved by short ones.

When a running request needs a block and none is free, the scheduler preempts by
recompute: the victim is the running request that is lowest priority, latest arrival
(`max(sort_key)`); its blocks are freed (full ones stay in the prefix cache, so a resumed
request often recomputes little) and it goes back to the waiting queue, where its original
arrival keeps it ahead of newer requests. The scheduler never touches tensors.

Admission control: `add` rejects a new request with Overloaded while `max_waiting`
requests wait; a preempted request always goes back to the queue, whatever its length.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from runtime.engine.errors import Overloaded
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int = 1024  # admission control: beyond this, new requests are rejected


@dataclass
class ScheduledBatch:
    """Tokens to compute per request this step (insertion order = scheduling order)."""

    budget: int
    num_tokens: dict[Request, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # heap by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, request: Request) -> None:
        """Queue a new request; raises Overloaded, queueing nothing, if the queue is full."""
        if self.num_waiting >= self.config.max_waiting:
            raise Overloaded(f"overloaded: {self.num_waiting} requests already waiting; retry later")
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        heapq.heappush(self.waiting, (request.sort_key(), request))

    def remove(self, request: Request) -> None:
        """Take a request out of the queues (finish or abort) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting = [(k, r) for k, r in self.waiting if r is not request]
            heapq.heapify(self.waiting)
        self.kv.free(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(budget=self.config.max_num_batched_tokens)
        # Decodes first, then prefill chunks; each group in priority/FCFS order.
        order = sorted(self.running, key=lambda r: (r.num_tokens_to_compute > 1, r.sort_key()))
        for request in order:
            if batch.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(request.num_tokens_to_compute, batch.budget)
            if self._allocate_or_preempt(request, n, batch):
                batch.num_tokens[request] = n
                batch.budget -= n
        if not batch.preempted:  # no room for newcomers when running ones were evicted
            self._admit_waiting(batch)
        return batch

    def _allocate_or_preempt(self, request: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        while not self.kv.allocate_slots(request, num_tokens):
            victim = max(self.running, key=Request.sort_key)
            self._preempt(victim, batch)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        batch.budget += batch.num_tokens.pop(victim, 0)  # undo if scheduled earlier this step
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self._enqueue(victim)  # never rejected: it was admitted once

    def _admit_waiting(self, batch: ScheduledBatch) -> None:
        while self.waiting and batch.budget > 0 and len(self.running) < self.config.max_num_seqs:
            _, request = self.waiting[0]
            hits = self.kv.get_computed_blocks(request)
            num_hit = len(hits) * self.kv.block_size
            n = min(request.num_tokens - num_hit, batch.budget)
            if not self.kv.allocate_slots(request, n, hits):
                break
            heapq.heappop(self.waiting)
            self.kv.record_lookup(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.num_tokens[request] = n
            batch.budget -= n

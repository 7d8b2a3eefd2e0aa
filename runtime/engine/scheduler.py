"""The scheduler: which requests run this step, and how many tokens each.

Per step, under a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):
1. running requests in decode (one token each, plus their speculative drafts while the budget has
   room beyond every decode's own token and `min_prefill_tokens` for pending prompts, and the pool
   has free blocks: drafts never preempt), highest priority first: never held back;
2. prefill chunks, by priority class: running requests still prefilling (one chunk each) before
   waiting ones of the same class, which come in queue order (earliest TTFT deadline, then
   arrival) with their prefix-cache hits, while the budget, the sequence cap and the pool allow. A queue
   head whose next blocks are in a KV tier (host memory, disk: kv_tiers/) waits, holding no step, until
   they are read back into the pool, and is admitted with them as hits.
   The queue head blocks the ones behind it (no overtaking), so a long prompt is not starved.

Stall-free batching: while any request decodes, prefill is cut to what keeps the predicted step
within the ITL target (the engine's `itl_target_s`, or a decoding request's own tighter one),
with at least `min_prefill_tokens` of it per step so prompts still progress, and a prompt's last
chunk taken whole if it fits the target itself (StepBudget.fit); with nothing decoding, prefill
runs at the full token budget. The target caps every step rather than a stream's mean gap: steps
with prefill are a large share of all gaps under load, so banking short gaps for longer steps
only moves ITL p99 up. Step costs come from a CostPredictor (the engine's online model, step_cost.py).

When a running request needs a block and none is free, the scheduler preempts by
recompute: the victim is the running request that is lowest priority, latest deadline and
arrival (`max(sort_key)`); its blocks are freed (full ones stay in the prefix cache, so a
resumed request often recomputes little) and it goes back to the waiting queue, where its
original key keeps it ahead of newer requests. The scheduler never touches tensors.

Admission control: `add` rejects a new request with Overloaded while `max_waiting` requests
wait, or when the prefill queued ahead of it (running prefills and waiting requests it would
not overtake) cannot be cleared at full speed within its `ttft_target_s`. A preempted request
always goes back to the queue, whatever its length.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field

from runtime.engine.errors import InvalidRequest, Overloaded
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.lora_manager import LoraManager
from runtime.engine.request import Request, RequestStatus
from runtime.engine.step_cost import DEFAULT_PRIOR, CostPredictor, StepBudget, StepShape, full_speed_prefill_s


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int = 1024  # admission control: beyond this, new requests are rejected
    itl_target_s: float | None = None  # step-time target while requests decode; None: token budget only
    min_prefill_tokens: int = 64  # prefill every step may carry, whatever the target


@dataclass
class ScheduledBatch:
    """Tokens to compute per request this step (insertion order = scheduling order)."""

    budget: int  # what is left of max_num_batched_tokens
    num_tokens: dict[Request, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # taken from the waiting queue this step
    target_s: float | None = None  # the step-time target prefill was cut to (None: full speed)
    token_budget: int = 0  # decodes + the prefill a fresh prompt could get (the budget gauge)
    predicted_s: float = 0.0  # the cost model's estimate of this step
    # What was scheduled (num_tokens, past_len summed): the step's shape unless a request was preempted after it
    # was added (then count the chunks that ran).
    shape: StepShape = field(default_factory=StepShape)

    @property
    def is_empty(self) -> bool:
        return not self.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, cost: CostPredictor = DEFAULT_PRIOR):
        self.config = config
        self.kv = kv
        self.cost = cost
        self.requests: dict[str, Request] = {}  # every live request, waiting or running, by id
        self.num_host_sampled = 0  # live requests whose sampling needs host state (Request.host_sampled)
        self.num_deadlines = 0  # live requests with a deadline_s: the engine looks for expired ones only then
        self.waiting: list[tuple[tuple[int, float, int], Request]] = []  # heap by sort_key
        self.running: list[Request] = []  # kept in sort_key order (keys never change): no sort per step
        # Persistent-batch rows (SequenceChunk.slot): each running request holds one; the lowest free first.
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.loras: LoraManager | None = None  # the engine's, when it serves LoRA adapters

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, request: Request, bounded: bool = True) -> None:
        """Queue a new request; raises Overloaded, queueing nothing, if the queue is full or
        cannot meet the request's TTFT target (InvalidRequest if its prompt alone cannot). `bounded=False`:
        neither check (a request that must not be refused: its KV was read from a prefill worker)."""
        if bounded and self.num_waiting >= self.config.max_waiting:
            raise Overloaded(f"overloaded: {self.num_waiting} requests already waiting; retry later")
        request.num_cached_hint = len(self.kv.get_computed_blocks(request)) * self.kv.block_size
        if bounded:
            self._check_ttft_target(request)
        self._enqueue(request)
        self.requests[request.request_id] = request
        self.num_host_sampled += request.host_sampled
        self.num_deadlines += request.params.deadline_s is not None

    def add_computed(self, request: Request, block_ids: list[int], num_hits: int) -> None:
        """A request that arrives with its prompt's KV computed in `block_ids` (a decode worker's pulled blocks;
        the first `num_hits` were hits on its own prefix cache): running from the next step in its sort_key
        place if it can start, else queued with what was read kept in the prefix cache. Never refused: once
        read, the prefill worker's pins are gone, and the handle could not be used again."""
        num_prompt = request.num_prompt_tokens
        request.block_ids, request.num_cached_blocks, request.num_computed_tokens = block_ids, num_hits, num_prompt
        self.kv.cache_computed_blocks(request)  # pulled full blocks serve later prompts too
        if not self.can_start(request):  # no sequence or adapter slot: queue for what the prefix cache lacks
            self.kv.free(request)
            request.num_computed_tokens = 0
            self.add(request, bounded=False)
            return
        self.kv.record_lookup(num_prompt, num_hits * self.kv.block_size)
        self._start_running(request)
        self.requests[request.request_id] = request
        self.num_host_sampled += request.host_sampled
        self.num_deadlines += request.params.deadline_s is not None

    def _check_ttft_target(self, request: Request) -> None:
        target = request.params.ttft_target_s
        if target is None:
            return
        key, priority = request.sort_key(), request.params.priority
        prefilling = [r for r in self.running if r.num_tokens_to_compute > 1 and r.params.priority <= priority]
        ahead = sum(r.num_tokens_to_compute for r in prefilling)
        ahead += sum(r.num_tokens - r.num_cached_hint for k, r in self.waiting if k < key)
        own = request.num_tokens - request.num_cached_hint
        estimate = full_speed_prefill_s(self.cost, ahead + own, self.config.max_num_batched_tokens)
        if estimate > target and ahead == 0:  # no retry helps: the prompt alone takes longer
            raise InvalidRequest(
                "ttft_target_s", f"{target:g} s is less than this prompt's prefill alone (~{estimate:.2f} s here)"
            )
        if estimate > target:
            retry = estimate - target  # by then the queue ahead has drained enough, at full speed
            raise Overloaded(
                f"overloaded: ttft_target_s {target:g} cannot be met: {ahead} prompt tokens are queued ahead, "
                f"{estimate:.2f} s of prefill at full speed with this one; retry after {retry:.2f} s",
                retry_after_s=retry,
                reason="slo",
            )

    def can_start(self, request: Request) -> bool:
        """Whether the request may run from the next step: a sequence free, and its adapter's slot."""
        lora_ok = self.loras is None or self.loras.can_acquire(request)
        return len(self.running) < self.config.max_num_seqs and lora_ok

    def _start_running(self, request: Request) -> None:
        if self.loras is not None:
            self.loras.acquire(request)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=Request.sort_key)
        request.slot = self._free_slots.pop() if self._free_slots else None  # None: the backend reads the list

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        if self.loras is not None:
            self.loras.release(request)

    def _enqueue(self, request: Request) -> None:
        heapq.heappush(self.waiting, (request.sort_key(), request))

    def remove(self, request: Request) -> None:
        """Take a request out of the queues (finish or abort) and free its blocks."""
        del self.requests[request.request_id]
        self.num_host_sampled -= request.host_sampled
        self.num_deadlines -= request.params.deadline_s is not None
        if request in self.running:
            self._stop_running(request)
        else:
            self.waiting = [(k, r) for k, r in self.waiting if r is not request]
            heapq.heapify(self.waiting)
        self.kv.free(request)
        if self.loras is not None:
            self.loras.unregister_request(request)

    def schedule(self) -> ScheduledBatch:
        self.kv.sync_tiers()
        batch = ScheduledBatch(budget=self.config.max_num_batched_tokens)
        # Running requests in priority order (a copy: preemption edits the list), one pass: decodes have one
        # token to compute (not one whose last token, in flight in an overlapped step, reaches max_tokens).
        decodes: list[Request] = []
        prefills: deque[Request] = deque()
        for r in self.running:
            uncomputed = len(r.all_token_ids) - r.num_computed_tokens
            if uncomputed == 1:
                if len(r.all_token_ids) - r.num_prompt_tokens < r.max_tokens:
                    decodes.append(r)
            elif uncomputed > 1:
                prefills.append(r)
        speculative = any(r.draft_token_ids for r in decodes)
        if speculative:
            prefilling = bool(self.waiting) or len(decodes) < len(self.running)
            self._schedule_speculative_decodes(decodes, batch, prefilling)
        else:
            self._schedule_decodes(decodes, batch)
        decoding = list(batch.num_tokens)
        step = StepBudget(self.cost, self._target_s(decoding), self.config.min_prefill_tokens)
        singles = [r for r in decoding if batch.num_tokens[r] == 1] if speculative else decoding
        step.add_decodes(len(singles), sum(r.num_computed_tokens for r in singles))
        if speculative:
            for request in decoding:  # decodes with drafts
                if batch.num_tokens[request] > 1:
                    step.add(batch.num_tokens[request], request.num_computed_tokens, prefill=False)
        batch.target_s = step.target_s
        batch.token_budget = len(decoding) + step.fit(batch.budget, 0)
        self._schedule_prefills(prefills, batch, step)
        batch.shape = step.shape
        batch.predicted_s = self.cost.predict(step.shape)  # a request preempted after it was added still counts
        return batch

    def _schedule_decodes(self, decodes: list[Request], batch: ScheduledBatch) -> None:
        """One token for each decode, in priority order: the common step, so no per-request work beyond a
        comparison unless its next token starts a new block."""
        block_size = self.kv.block_size
        for request in decodes:
            if batch.budget == 0:
                return
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if request.num_computed_tokens < len(request.block_ids) * block_size or self._allocate_or_preempt(
                request, 1, batch
            ):
                batch.num_tokens[request] = 1  # a later allocation may still preempt it: read below
                batch.budget -= 1

    def _schedule_speculative_decodes(self, decodes: list[Request], batch: ScheduledBatch, prefilling: bool) -> None:
        """Decodes with speculative drafts: each decode's own token first, drafts while the budget has room
        beyond every decode's token and the prompts' minimum share, and blocks no decode's token needs."""
        spare = batch.budget - len(decodes) - (self.config.min_prefill_tokens if prefilling else 0)
        # Blocks the decodes' own next tokens need: drafts never take them (so never cause a preemption).
        reserve = sum(self.kv.blocks_for(r.num_computed_tokens + 1) > len(r.block_ids) for r in decodes)
        for request in decodes:
            reserve -= self.kv.blocks_for(request.num_computed_tokens + 1) > len(request.block_ids)
            if batch.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            drafts = self._schedule_drafts(request, min(spare, batch.budget - 1), reserve)
            if drafts or self._allocate_or_preempt(request, 1, batch):
                batch.num_tokens[request] = 1 + drafts  # a later allocation may still preempt it: read below
                batch.budget -= 1 + drafts
                spare -= drafts

    def _schedule_drafts(self, request: Request, room: int, reserve: int) -> int:
        """Allocate slots for the request's token plus as many of its drafts as `room` allows and the
        pool spares beyond `reserve` blocks; returns the drafts kept (0: nothing allocated; the caller
        allocates the token alone). Drafts are a bet: they never preempt, and shrink when blocks are short."""
        drafts = max(0, min(len(request.draft_token_ids), room))
        spare_blocks = self.kv.pool.num_free_blocks - reserve
        held, computed = len(request.block_ids), request.num_computed_tokens
        while drafts and self.kv.blocks_for(computed + 1 + drafts) - held > spare_blocks:
            drafts -= 1
        if drafts:
            assert self.kv.allocate_slots(request, 1 + drafts), "fits: checked above"
        del request.draft_token_ids[drafts:]
        return drafts

    def _target_s(self, decoding: list[Request]) -> float | None:
        """The step-time target: the tightest ITL target among this step's decodes; none without decodes."""
        targets = [r.params.itl_target_s for r in decoding if r.params.itl_target_s is not None]
        if decoding and self.config.itl_target_s is not None:
            targets.append(self.config.itl_target_s)
        return min(targets, default=None)

    def _schedule_prefills(self, running: deque[Request], batch: ScheduledBatch, step: StepBudget) -> None:
        """Running prefills and the waiting queue, merged by priority class (running first within one)."""
        admitting = True
        while batch.budget > 0:
            while running and running[0].status is not RequestStatus.RUNNING:  # preempted this step
                running.popleft()
            admitting = admitting and not batch.preempted  # no room for newcomers once running ones were evicted
            head = self._admissible_head() if admitting else None
            if running and (head is None or running[0].params.priority <= head.params.priority):
                request = running.popleft()
                want = min(request.num_tokens_to_compute, batch.budget)
                n = step.fit(want, request.num_computed_tokens, want == request.num_tokens_to_compute)
                if n == 0:
                    return
                if self._allocate_or_preempt(request, n, batch):
                    step.add(n, request.num_computed_tokens, prefill=True)
                    batch.num_tokens[request] = n
                    batch.budget -= n
            elif head is not None:
                admitting = self._admit(head, batch, step)
            else:
                return

    def _admissible_head(self) -> Request | None:
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return self.waiting[0][1]
        return None

    def _allocate_or_preempt(self, request: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        while not self.kv.allocate_slots(request, num_tokens):
            victim = self.running[-1]  # the lowest priority, latest deadline and arrival
            self._preempt(victim, batch)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self._stop_running(victim)
        batch.budget += batch.num_tokens.pop(victim, 0)  # undo if scheduled earlier this step
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.draft_token_ids.clear()  # its slots are gone; drafts are proposed again once it decodes
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self._enqueue(victim)  # never rejected: it was admitted once

    def _admit(self, request: Request, batch: ScheduledBatch, step: StepBudget) -> bool:
        """Start the queue head with a first chunk; False (changing nothing) if it does not fit."""
        hits = self.kv.get_computed_blocks(request)
        if self.kv.loading_from_tiers(request, hits):  # admitted once its blocks are back in the pool
            return False
        if self.loras is not None and not self.loras.can_acquire(request):  # every slot's adapter is running
            return False
        num_hit = len(hits) * self.kv.block_size
        want = min(request.num_tokens - num_hit, batch.budget)
        n = step.fit(want, num_hit, want == request.num_tokens - num_hit)
        if n == 0 or not self.kv.allocate_slots(request, n, hits):
            return False
        heapq.heappop(self.waiting)
        self.kv.admitted(request)
        self.kv.record_lookup(request.num_tokens, num_hit)
        request.num_computed_tokens = num_hit
        self._start_running(request)
        step.add(n, num_hit, prefill=True)
        batch.num_tokens[request] = n
        batch.budget -= n
        batch.admitted.append(request)
        return True

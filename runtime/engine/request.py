"""A request's life in the engine: tokens, progress, blocks, status and timing."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from executors.sampling import SamplingParams, SamplingState, TokenLogprobs
from runtime.engine.outputs import RequestTimingStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to recompute its tokens
    FINISHED = "finished"


@dataclass(slots=True)
class RequestTiming:
    """Wall-clock marks (time.monotonic()) from which per-request stats are derived."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    def on_token(self, now: float) -> None:
        if self.last_token is None:
            self.first_token = now
        else:
            self.inter_token_latencies.append(now - self.last_token)
        self.last_token = now

    def summary(self) -> RequestTimingStats:
        def since(mark: float | None, start: float | None) -> float | None:
            return None if mark is None or start is None else mark - start

        return RequestTimingStats(
            queue_time_s=since(self.first_scheduled, self.arrival),
            ttft_s=since(self.first_token, self.arrival),
            e2e_s=since(self.finished, self.arrival),
            inter_token_latencies_s=list(self.inter_token_latencies),
        )


@dataclass(eq=False, slots=True)  # slots: its fields are read for every request every step
class Request:
    """One request. Its tokens live in ONE list, `all_token_ids`: the prompt (given at
    construction, copied) followed by each sampled token as it is appended. The engine reads
    it every step (a chunk's tokens, block hashes), so nothing per step rebuilds it;
    `prompt_token_ids` and `output_token_ids` are slices (copies) for the rare reader."""

    request_id: str
    all_token_ids: list[int]  # the prompt at construction; sampled tokens are appended
    params: SamplingParams
    sampling: SamplingState
    arrival_order: int  # FCFS tie-break within a priority class
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(arrival=time.monotonic()))
    num_computed_tokens: int = 0  # tokens whose K/V sit in the pool
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_hint: int = 0  # prefix-cache hit tokens found when queued (the SLO estimate's discount)
    # Speculative tokens proposed to follow all_token_ids, verified next step. Never part of
    # all_token_ids (so never hashed into the prefix cache) until accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end it: its params' and the EOS ids unless ignored
    pending_row: int = -1  # its row in the overlapped step in flight, whose sampled token is its last (placeholder)
    slot: int | None = None  # its row in the backend's persistent batch while it runs (the scheduler's)
    lora_id: str | None = None  # its LoRA adapter's content digest (params.lora names it): keys its prefix cache
    lora_slot: int | None = None  # the backend's slot of its adapter while it runs (lora_manager.py)
    prefill_only: bool = False  # a prefill worker's: it ends with its first token, its KV handed on (disagg.py)
    # params.prompt_logprobs set: entry i scores prompt token i given those before it (entry 0: None), filled as
    # its prefill chunks run (step_update.py); a preempted request keeps what it has.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = field(init=False)
    max_tokens: int = field(init=False)  # the most tokens it may generate: its params', read every step

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.all_token_ids)  # never grow the caller's prompt list
        if self.params.max_tokens is None:
            raise ValueError("max_tokens must be resolved (admission does) before a Request is made")
        self.max_tokens = self.params.max_tokens
        self.num_prompt_tokens = len(self.all_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are still being computed: every prompt position's logits are needed, so its
        prefill runs whole (no prefix-cache hits) and returns a logits row per token."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def host_sampled(self) -> bool:
        """Its tokens are sampled from host state that must hold every earlier token: penalties (counts),
        logprobs or a grammar's matcher. Such a request keeps the engine's steps from overlapping."""
        return self.sampling.host_sampled

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def ttft_deadline(self) -> float:
        """When the first token is due (clock seconds); infinite without a TTFT target."""
        target = self.params.ttft_target_s
        return math.inf if target is None else self.timing.arrival + target

    def sort_key(self) -> tuple[int, float, int]:
        """Lower runs first: priority class, then earliest TTFT deadline, then arrival (FCFS)."""
        return (self.params.priority, self.ttft_deadline, self.arrival_order)

"""A request's life in the engine: tokens, progress, blocks, status and timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from runtime.engine.sampler import SamplingState
from runtime.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to recompute its tokens
    FINISHED = "finished"


@dataclass
class RequestTiming:
    """Wall-clock marks (time.monotonic()) from which per-request stats are derived."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.inter_token_latencies.append(now - self.last_token)
        self.last_token = now

    def summary(self) -> dict:
        def since(mark: float | None, start: float | None) -> float | None:
            return None if mark is None or start is None else mark - start

        return {
            "queue_time_s": since(self.first_scheduled, self.arrival),
            "ttft_s": since(self.first_token, self.arrival),
            "e2e_s": since(self.finished, self.arrival),
            "inter_token_latencies_s": list(self.inter_token_latencies),
        }


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    arrival_order: int  # FCFS tie-break within a priority class
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(arrival=time.monotonic()))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V sit in the pool
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority class, then arrival (FCFS)."""
        return (self.params.priority, self.arrival_order)

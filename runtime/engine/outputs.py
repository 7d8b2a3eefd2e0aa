"""What the engine hands back: per-step deltas and finished completions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TypedDict

from executors.sampling import TokenLogprobs

# TokenLogprobs (executors/sampling/) is part of the outputs: named here for runtime.triton_model, which
# sees the engine's outputs but not the executors.
__all__ = [
    "FINISH_REASONS",
    "CompletionOutput",
    "RequestOutput",
    "RequestStats",
    "RequestTimingStats",
    "TokenLogprobs",
    "TokenOutput",
    "merge_steps",
]

# "handoff": a prefill worker's prefill-only request, its KV handed to a decode worker (runtime/engine/disagg.py)
FINISH_REASONS = ("stop", "length", "abort", "deadline", "error", "handoff")


class RequestTimingStats(TypedDict):
    """Seconds from a request's arrival; None when the mark was never reached."""

    queue_time_s: float | None  # until first scheduled
    ttft_s: float | None  # until the first token
    e2e_s: float | None  # until finished
    inter_token_latencies_s: list[float]  # between consecutive output tokens


class RequestStats(RequestTimingStats):
    """A finished request's stats (RequestOutput.stats)."""

    num_preemptions: int


@dataclass(slots=True)
class TokenOutput:
    """One step's tokens for one request as the engine core produces them, before detokenization (the output
    processor turns them into RequestOutputs). `finish_reason`: stop token, length, abort, deadline, error."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None
    kv_handle: str | None = None  # finish_reason "handoff": as RequestOutput.kv_handle
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first token's output: as RequestOutput's

    def absorb(self, later: TokenOutput) -> None:
        """Take `later` (the same request's next output) into this one, as if one step had made both: a front end
        that fell behind gets one output per request for the steps it missed."""
        self.token_ids = self.token_ids + later.token_ids
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs = self.logprobs + later.logprobs
        self.num_output_tokens = later.num_output_tokens
        self.finish_reason, self.stats, self.error, self.kv_handle = (
            later.finish_reason,
            later.stats,
            later.error,
            later.kv_handle,
        )
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs


def merge_steps(
    steps: Iterable[list[TokenOutput]], into: dict[str, TokenOutput] | None = None
) -> dict[str, TokenOutput]:
    """Several steps' outputs as one output per request (`TokenOutput.absorb`), in the order requests first
    appear; `into`: outputs merged before, which the steps continue. The outputs are taken over (changed)."""
    merged = {} if into is None else into
    for outputs in steps:
        for out in outputs:
            earlier = merged.get(out.request_id)
            if earlier is None:
                merged[out.request_id] = out
            else:
                earlier.absorb(out)
    return merged


@dataclass
class RequestOutput:
    """One step's news for one request; `text` and `token_ids` are deltas."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    stats: RequestStats | None = None  # per-request timing, on the final output
    error: str | None = None  # why, when finish_reason is "error" (the engine failed the step)
    kv_handle: str | None = None  # finish_reason "handoff": the KV handle's JSON (engine_format/kv_handle.py)
    # SamplingParams.prompt_logprobs set: on the first output, each prompt token scored given those before it
    # (the first None), with texts as `logprobs`'
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later` (of the same request), as one delta."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        token_ids = self.token_ids + later.token_ids
        return replace(
            later,
            text=self.text + later.text,
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass
class CompletionOutput:
    """A whole completion, assembled from a request's deltas (LLM.generate's result)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stats: RequestStats | None = None
    error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        self.text += delta.text
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finished:
            self.finish_reason, self.stats, self.error = delta.finish_reason, delta.stats, delta.error

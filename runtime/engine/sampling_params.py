"""Per-request generation parameters, validated at admission."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from runtime.engine.errors import InvalidRequest

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and when to stop. temperature=0 means greedy.

    Penalties follow the OpenAI/vLLM definitions: repetition_penalty (>1 discourages tokens
    already in prompt or output: positive logits divided, negative multiplied),
    presence_penalty (subtracted once if a token appeared in the output),
    frequency_penalty (subtracted per occurrence in the output).
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs first; FCFS within a priority
    deadline_s: float | None = None  # give up (finish_reason "deadline") this long after arrival
    # Latency targets (SLOs). ttft_target_s: orders waiting prefills (earliest deadline first within
    # a priority) and rejects the request with Overloaded at once if the queue cannot meet it.
    # itl_target_s: while it decodes, steps carry only the prefill that keeps them within it.
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    # Prefix-cache isolation: only requests with the same salt share cached blocks (the gateway
    # sets one per tenant; None shares with every other unsalted request).
    cache_salt: str | None = None
    # Tokens per streamed delta (None: the server's EngineArgs.stream_interval; the larger of the two applies).
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from user JSON-ish input; unknown fields are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequest(unknown[0], f"unknown parameter; allowed: {', '.join(sorted(known))}")
        return cls(**data)

    def validate(self) -> None:
        _int("max_tokens", self.max_tokens, lo=1)
        _num("temperature", self.temperature, lo=0.0)
        _int("top_k", self.top_k, lo=0)
        _num("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _num("min_p", self.min_p, lo=0.0, hi=1.0)
        _num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _int("seed", self.seed, lo=0)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        _int("priority", self.priority, lo=-(2**31), hi=2**31 - 1)
        if self.stream_interval is not None:
            _int("stream_interval", self.stream_interval, lo=1, hi=2**31 - 1)
        for name in ("deadline_s", "ttft_target_s", "itl_target_s"):
            if getattr(self, name) is not None:
                _num(name, getattr(self, name), lo=0.0, lo_open=True)
        if self.ttft_target_s is not None and self.deadline_s is not None and self.ttft_target_s > self.deadline_s:
            raise InvalidRequest(
                "ttft_target_s", f"must not exceed deadline_s ({self.ttft_target_s} > {self.deadline_s})"
            )
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= 256):
            raise InvalidRequest("cache_salt", "must be a non-empty string of at most 256 characters")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, "must be true or false")


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(name, f"must be an integer (got {value!r})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidRequest(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}] (got {value})")


def _num(name: str, value: Any, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(name, f"must be a finite number (got {value!r})")
    below = value <= lo if lo_open else value < lo
    if below or (hi is not None and value > hi):
        interval = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise InvalidRequest(name, f"must be in {interval} (got {value})")

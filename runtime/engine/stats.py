"""Engine-level counters and gauges (a snapshot per call; Triton metrics read these)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineCounters:
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    steps: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    rejected_overloaded: int = 0
    rejected_invalid: int = 0


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float  # fraction of blocks referenced by requests
    kv_blocks: dict[str, int]  # free / cached / used
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    finished: dict[str, int]
    rejected_overloaded: int
    rejected_invalid: int

"""Engine-level counters and gauges (a snapshot per call; Triton metrics read these)."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field

from runtime.engine.kv_tiers.tiers import TierStats
from runtime.engine.lora_manager import LoraStats
from runtime.engine.step_cost import StepCost

STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
PREFILL_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MAX_STEP_RECORDS = 4096  # kept for a reader (Triton metrics) that drains them; older ones are dropped


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # upper bounds (le); counts has one more entry, for +Inf
    counts: tuple[int, ...]  # per bucket, not cumulative
    total: float
    count: int


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total, self.count)


@dataclass(frozen=True)
class EngineProgress:
    """Whether an engine loop is moving, cheaply: `steps` run so far, requests `unfinished`, and why
    the loop stopped (None while it runs). A supervisor watches it to tell a busy engine from a stuck one."""

    steps: int
    unfinished: int
    problem: str | None = None


@dataclass(slots=True)  # not frozen: one per step, and a frozen __init__ costs a setattr per field
class StepRecord:
    """One engine step as it ran."""

    seconds: float  # wall time on the engine's clock: schedule, backend, sample, detokenize
    predicted_s: float  # the cost model's estimate when it was scheduled
    prefill_tokens: int
    decode_seqs: int
    token_budget: int  # decodes + the prefill the ITL target allowed a fresh prompt


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding since start (vLLM's spec-decode metrics)."""

    drafts: int  # verify passes that carried drafts (one per request per step)
    draft_tokens: int  # drafts proposed and verified
    accepted_tokens: int  # of which accepted
    accepted_per_position: tuple[int, ...]  # accepted at draft position 0, 1, ...

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify pass: the accepted drafts plus the one the target adds."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


@dataclass
class SpecDecodeCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.drafts, self.draft_tokens, self.accepted_tokens, tuple(self.accepted_per_position))


@dataclass(frozen=True)
class GrammarStats:
    """Structured output since the engine started (runtime/engine/grammar_cache.py)."""

    requests: int = 0  # requests that generated under a grammar
    cache_hits: int = 0  # grammar lookups that found it compiled (or compiling)
    compiles: int = 0
    compile_failures: int = 0  # grammars refused as invalid
    compile_timeouts: int = 0  # requests refused because their grammar compiled too slowly
    masked_steps: int = 0  # rows sampled or verified under a grammar's mask
    violations: int = 0  # kept tokens a grammar refused (0 unless a sampler skipped a mask)


@dataclass
class EngineCounters:
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    steps: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    rejected_overloaded: int = 0  # waiting queue full
    rejected_slo: int = 0  # TTFT target unreachable
    rejected_invalid: int = 0
    slo: Counter[str] = field(default_factory=Counter)  # "ttft_met", "ttft_missed", "itl_met", "itl_missed"
    step_time: Histogram = field(default_factory=lambda: Histogram(STEP_TIME_BUCKETS))
    prefill_per_step: Histogram = field(default_factory=lambda: Histogram(PREFILL_TOKEN_BUCKETS))
    step_token_budget: int = 0  # the last step's
    recent_steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=MAX_STEP_RECORDS))
    spec: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)

    def record_step(self, record: StepRecord) -> None:
        self.step_time.observe(record.seconds)
        self.prefill_per_step.observe(record.prefill_tokens)
        self.step_token_budget = record.token_budget
        self.recent_steps.append(record)

    def record_latency(self, kind: str, seconds: float, target_s: float | None) -> None:
        """One TTFT or inter-token latency against its target (none: not counted)."""
        if target_s is not None:
            self.slo[f"{kind}_{'met' if seconds <= target_s else 'missed'}"] += 1


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
    rejected_slo: int = 0
    slo: dict[str, int] = field(default_factory=dict)  # TTFT / ITL targets met and missed (ITL: per token)
    step_time_s: HistogramSnapshot = field(default_factory=lambda: Histogram(STEP_TIME_BUCKETS).snapshot())
    prefill_tokens_per_step: HistogramSnapshot = field(
        default_factory=lambda: Histogram(PREFILL_TOKEN_BUCKETS).snapshot()
    )
    step_token_budget: int = 0  # the last step's: decodes + the prefill its ITL target allowed
    itl_target_s: float | None = None  # the engine's (requests may carry tighter ones)
    step_cost: StepCost | None = None  # the learned cost model's coefficients
    spec_decode: SpecDecodeStats | None = None  # None: speculation off
    kv_max_concurrency: float = 0.0  # sequences of max_seq_len the pool holds (4x with an int8/fp8 cache)
    grammar: GrammarStats = field(default_factory=GrammarStats)  # structured output
    kv_tiers: TierStats | None = None  # the KV cache's host and disk tiers; None: none
    lora: LoraStats | None = None  # LoRA adapters served; None: none

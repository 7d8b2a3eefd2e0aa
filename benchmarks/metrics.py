"""Per-request timing records and the serving metrics computed from them.

Definitions (the ones vLLM's and NVIDIA's serving benchmarks use):
- TTFT: first streamed token's arrival - request send time.
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), per request.
- ITL: gap between consecutive streamed chunks; a chunk carrying k > 1 tokens counts as k
  gaps of gap/k, so ITL stays per token and agrees with TPOT.
- Goodput: completed requests per second that meet every stated SLO.
Throughputs divide by the wall time of the measured phase (warm-up excluded).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    start: float  # send time, seconds on one monotonic clock
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each chunk
    end: float = 0.0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    def validate(self) -> None:
        """Refuse records a buggy client could produce (would silently skew every metric)."""
        if len(self.chunk_times) != len(self.chunk_tokens):
            raise ValueError("chunk_times and chunk_tokens differ in length")
        if any(n < 1 for n in self.chunk_tokens):
            raise ValueError("a chunk must carry at least one token")
        times = [self.start, *self.chunk_times, self.end]
        if any(b < a for a, b in itertools.pairwise(times)):
            raise ValueError("timestamps must not decrease: start <= chunks <= end")

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def itls(self) -> list[float]:
        gaps: list[float] = []
        for prev, cur, k in zip(self.chunk_times, self.chunk_times[1:], self.chunk_tokens[1:], strict=False):
            gaps += [(cur - prev) / k] * k
        return gaps


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met_by(self, record: RequestRecord) -> bool:
        tpot = record.tpot
        return record.ok and record.ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """p50/p90/p99 and mean (linear interpolation, numpy's default), scaled to ms by default."""
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64) * scale
    out = {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in PERCENTILES}
    out["mean"] = round(float(arr.mean()), 3)
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict:
    """Serving metrics of one measured phase."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    for r in records:
        r.validate()
    ok = [r for r in records if r.ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "duration_s": round(duration_s, 3),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "request_s": round(len(ok) / duration_s, 4),
        "output_tok_s": round(output_tokens / duration_s, 2),
        "goodput_req_s": round(sum(slo.met_by(r) for r in ok) / duration_s, 4),
        "slo_attainment": round(sum(slo.met_by(r) for r in ok) / len(records), 4) if records else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles([g for r in ok for g in r.itls()]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
    }

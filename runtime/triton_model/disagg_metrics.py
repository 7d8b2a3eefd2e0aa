"""Disaggregation's Prometheus families, exported through Triton's /metrics beside the engine's (metrics.py):
KV reads (count, failures, bytes, a histogram of their time), handoffs, pinned and staged blocks, pins that
expired unread, and requests recomputed after a failed read. Zero on a `both` worker but for recomputes."""

from __future__ import annotations

import threading
from typing import Any

from runtime.engine.disagg import DisaggStats
from runtime.engine.kv_import import PullRecord

TRANSFER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
GAUGES = {
    "trtserve_kv_pinned_blocks": ("KV blocks pinned for decode workers (prefill role).", "pinned_blocks"),
    "trtserve_kv_staged_blocks": ("KV blocks staged for reads in flight (decode role).", "staged_blocks"),
}
COUNTERS = {
    "trtserve_kv_transfers_total": ("KV reads completed (decode role).", "pulls"),
    "trtserve_kv_transfer_failures_total": ("KV reads that failed or were refused (decode role).", "pull_failures"),
    "trtserve_kv_transfer_bytes_total": ("KV bytes read from prefill workers (decode role).", "pulled_bytes"),
    "trtserve_kv_handoffs_total": ("Requests handed to decode workers after their first token (prefill role).",
                                   "handoffs"),
    "trtserve_kv_pins_expired_total": ("Pins that timed out unread (prefill role).", "pins_expired"),
    "trtserve_kv_recomputes_total": ("Requests with a handle recomputed here instead of read.", "recomputes"),
}  # fmt: skip


class DisaggMetrics:
    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        kinds = pb_utils.MetricFamily
        self._families = [kinds(name=n, description=d, kind=kinds.GAUGE) for n, (d, _) in GAUGES.items()]
        self._families += [kinds(name=n, description=d, kind=kinds.COUNTER) for n, (d, _) in COUNTERS.items()]
        histogram = kinds(name="trtserve_kv_transfer_seconds", description="Time of one request's KV read.",
                          kind=kinds.HISTOGRAM)  # fmt: skip
        self._families.append(histogram)
        metrics = [f.Metric(labels=labels) for f in self._families[:-1]]
        self.gauges = dict(zip(GAUGES, metrics[: len(GAUGES)], strict=True))
        self.counters = dict(zip(COUNTERS, metrics[len(GAUGES) :], strict=True))
        self.histogram = histogram.Metric(labels=labels, buckets=TRANSFER_BUCKETS)
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = False

    def update(self, stats: DisaggStats, records: list[PullRecord]) -> None:
        with self._lock:
            if self._closed:
                return
            for record in records:
                self.histogram.observe(record.seconds)
            for name, (_, attribute) in GAUGES.items():
                self.gauges[name].set(float(getattr(stats, attribute)))
            for name, (_, attribute) in COUNTERS.items():
                value = float(getattr(stats, attribute))
                if value > self._last.get(name, 0.0):
                    self.counters[name].increment(value - self._last.get(name, 0.0))
                self._last[name] = value

    def close(self) -> None:
        """As TritonMetrics.close: release metrics and families while the stub's shared memory is there."""
        with self._lock:
            self._closed = True
            self.gauges.clear()
            self.counters.clear()
            del self.histogram
            self._families.clear()

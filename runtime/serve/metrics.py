"""Prometheus metric families exported through Triton's /metrics by the Python backend.

Histograms are observed when a request finishes (TTFT, inter-token latency, queue time,
end-to-end) and, per engine step, from the step records the refresh thread drains (step time,
prefill tokens per step); gauges and counters are refreshed from the engine's stats by that thread.
`pb_utils` is passed in because it only exists inside Triton's Python backend stub.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from runtime.engine.outputs import FINISH_REASONS, RequestOutput
from runtime.engine.stats import PREFILL_TOKEN_BUCKETS, STEP_TIME_BUCKETS, EngineStats, StepRecord

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5]


def _slo(key: str) -> Callable[[EngineStats], float]:
    return lambda s: s.slo.get(key, 0)


# name -> (description, how to read it from EngineStats)
GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "trtserve_num_requests_running": ("Requests in the running batch.", lambda s: s.running),
    "trtserve_num_requests_waiting": ("Requests waiting to be scheduled.", lambda s: s.waiting),
    "trtserve_kv_cache_usage_ratio": ("Fraction of KV blocks held by requests.", lambda s: s.kv_usage),
    # vLLM's names for the same values: what autoscalers and endpoint pickers (llm-d, the Gateway API
    # inference extension) read. Triton accepts ':' in metric family names.
    "vllm:num_requests_running": ("Requests in the running batch (vLLM's name).", lambda s: s.running),
    "vllm:num_requests_waiting": ("Requests waiting to be scheduled (vLLM's name).", lambda s: s.waiting),
    "vllm:kv_cache_usage_perc": ("Fraction of KV blocks held by requests (vLLM's name).", lambda s: s.kv_usage),
    "trtserve_kv_cache_used_blocks": ("KV blocks held by requests.", lambda s: s.kv_blocks["used"]),
    "trtserve_kv_cache_cached_blocks": ("Free KV blocks holding a cached prefix.", lambda s: s.kv_blocks["cached"]),
    "trtserve_step_token_budget": ("Last step's decodes + the prefill its ITL target let in.",
                                   lambda s: s.step_token_budget),
}  # fmt: skip
COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "trtserve_prefix_cache_queries_total": ("Prompt tokens looked up in the cache.", lambda s: s.prefix_cache_queries),
    "trtserve_prefix_cache_hits_total": ("Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
    "vllm:prefix_cache_queries_total": ("Prompt tokens looked up (vLLM's name).", lambda s: s.prefix_cache_queries),
    "vllm:prefix_cache_hits_total": ("Prompt tokens found in the cache (vLLM's name).", lambda s: s.prefix_cache_hits),
    "trtserve_preemptions_total": ("Requests preempted for lack of KV blocks.", lambda s: s.preemptions),
    "trtserve_prompt_tokens_total": ("Prompt tokens computed.", lambda s: s.prompt_tokens),
    "trtserve_generation_tokens_total": ("Tokens generated.", lambda s: s.generation_tokens),
    "trtserve_requests_rejected_overloaded_total": ("Rejected: waiting queue full.", lambda s: s.rejected_overloaded),
    "trtserve_requests_rejected_invalid_total": ("Rejected: invalid input.", lambda s: s.rejected_invalid),
    "trtserve_requests_rejected_slo_total": ("Rejected: TTFT target unreachable.", lambda s: s.rejected_slo),
    # SLO attainment: first tokens against the request's TTFT target; inter-token latencies (each
    # counted) against the request's ITL target, else the engine's.
    "trtserve_ttft_slo_met_total": ("First tokens within their TTFT target.", _slo("ttft_met")),
    "trtserve_ttft_slo_missed_total": ("First tokens past their TTFT target.", _slo("ttft_missed")),
    "trtserve_itl_slo_met_total": ("Inter-token latencies within their ITL target.", _slo("itl_met")),
    "trtserve_itl_slo_missed_total": ("Inter-token latencies past their ITL target.", _slo("itl_missed")),
}  # fmt: skip
HISTOGRAMS = {
    "trtserve_time_to_first_token_seconds": ("Time to first token.", LATENCY_BUCKETS),
    "trtserve_inter_token_latency_seconds": ("Time between consecutive output tokens.", ITL_BUCKETS),
    "trtserve_queue_time_seconds": ("Time from arrival to first scheduling.", LATENCY_BUCKETS),
    "trtserve_e2e_request_latency_seconds": ("Time from arrival to the last token.", LATENCY_BUCKETS),
    "trtserve_step_duration_seconds": ("Engine step wall time (schedule, model, sample, detokenize).",
                                       list(STEP_TIME_BUCKETS)),
    "trtserve_prefill_tokens_per_step": ("Prompt tokens computed per engine step.", list(PREFILL_TOKEN_BUCKETS)),
}  # fmt: skip


class TritonMetrics:
    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        """`pb_utils`: Triton's triton_python_backend_utils module (untyped; only inside the stub)."""
        kinds = pb_utils.MetricFamily
        self._families: list[Any] = []  # must outlive their metrics

        def family(name: str, description: str, kind: Any) -> Any:
            self._families.append(kinds(name=name, description=description, kind=kind))
            return self._families[-1]

        self.gauges = {n: family(n, d, kinds.GAUGE).Metric(labels=labels) for n, (d, _) in GAUGES.items()}
        self.counters = {n: family(n, d, kinds.COUNTER).Metric(labels=labels) for n, (d, _) in COUNTERS.items()}
        self.histograms = {
            n: family(n, d, kinds.HISTOGRAM).Metric(labels=labels, buckets=b) for n, (d, b) in HISTOGRAMS.items()
        }
        finished = family("trtserve_request_success_total", "Finished requests by finish reason.", kinds.COUNTER)
        self.finished = {
            reason: finished.Metric(labels={**labels, "finish_reason": reason}) for reason in FINISH_REASONS
        }
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe_finished(self, out: RequestOutput) -> None:
        stats = out.stats
        with self._lock:
            if stats is not None:
                for name, value in (
                    ("trtserve_time_to_first_token_seconds", stats.get("ttft_s")),
                    ("trtserve_queue_time_seconds", stats.get("queue_time_s")),
                    ("trtserve_e2e_request_latency_seconds", stats.get("e2e_s")),
                ):
                    if value is not None:
                        self.histograms[name].observe(value)
                for itl in stats.get("inter_token_latencies_s", []):
                    self.histograms["trtserve_inter_token_latency_seconds"].observe(itl)
            if out.finish_reason in self.finished:
                self.finished[out.finish_reason].increment(1)

    def update(self, stats: EngineStats, steps: Sequence[StepRecord] = ()) -> None:
        """Refresh gauges and counters from `stats`; observe `steps` (LLMEngine.take_step_records())."""
        with self._lock:
            for step in steps:
                self.histograms["trtserve_step_duration_seconds"].observe(step.seconds)
                self.histograms["trtserve_prefill_tokens_per_step"].observe(step.prefill_tokens)
            for name, (_, read) in GAUGES.items():
                self.gauges[name].set(float(read(stats)))
            for name, (_, read) in COUNTERS.items():
                value = float(read(stats))
                if value > self._last.get(name, 0.0):
                    self.counters[name].increment(value - self._last.get(name, 0.0))
                self._last[name] = value

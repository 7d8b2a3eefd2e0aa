"""Prometheus metric families exported through Triton's /metrics by the Python backend.

Histograms are observed when a request finishes (TTFT, inter-token latency, queue time,
end-to-end) and, per engine step, from the step records the refresh thread drains (step time,
prefill tokens per step); gauges and counters (labelled ones too: accepted drafts per position) are
refreshed from the engine's stats by that thread. Speculative decoding's families exist only while it is on.
`pb_utils` is passed in because it only exists inside Triton's Python backend stub.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from runtime.engine.kv_tiers import TierStats
from runtime.engine.lora_manager import LoraStats
from runtime.engine.outputs import FINISH_REASONS, RequestOutput
from runtime.engine.stats import (
    PREFILL_TOKEN_BUCKETS,
    STEP_TIME_BUCKETS,
    EngineStats,
    SpecDecodeStats,
    StepRecord,
)

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
GRAMMAR_COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5]


def _slo(key: str) -> Callable[[EngineStats], float]:
    return lambda s: s.slo.get(key, 0)


def _spec(read: Callable[[SpecDecodeStats], float]) -> Callable[[EngineStats], float]:
    return lambda s: 0.0 if s.spec_decode is None else read(s.spec_decode)


def _accepted_per_position(stats: EngineStats) -> dict[str, float]:
    return {str(i): n for i, n in enumerate(stats.spec_decode.accepted_per_position if stats.spec_decode else ())}


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
    "trtserve_kv_cache_blocks_total": ("KV blocks in the pool.", lambda s: sum(s.kv_blocks.values())),
    "trtserve_kv_cache_max_concurrency": ("Sequences of max_seq_len the KV pool holds (its dtype decides).",
                                          lambda s: s.kv_max_concurrency),
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
    # Structured output (runtime/engine/grammar_cache.py).
    "trtserve_grammar_requests_total": ("Requests generated under a grammar (guided_*, response_format, tools).",
                                        lambda s: s.grammar.requests),
    "trtserve_grammar_masked_steps_total": ("Tokens sampled or verified under a grammar's mask.",
                                            lambda s: s.grammar.masked_steps),
    "trtserve_grammar_cache_hits_total": ("Grammar lookups that found it compiled or compiling.",
                                          lambda s: s.grammar.cache_hits),
    "trtserve_grammar_compile_failures_total": ("Grammars refused as invalid.", lambda s: s.grammar.compile_failures),
    "trtserve_grammar_compile_timeouts_total": ("Requests refused: grammar compile past grammar_compile_timeout_s.",
                                                lambda s: s.grammar.compile_timeouts),
}  # fmt: skip
# Speculative decoding, exported while it is on (vLLM's names where vLLM has them: its
# vllm:spec_decode_* counters; it derives the rate and the mean length in PromQL).
SPEC_GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "trtserve_spec_decode_acceptance_rate": ("Accepted / proposed draft tokens since start.",
                                             _spec(lambda d: d.acceptance_rate)),
    "trtserve_spec_decode_mean_acceptance_length": ("Tokens emitted per verify pass since start (accepted + 1).",
                                                    _spec(lambda d: d.mean_acceptance_length)),
}  # fmt: skip
SPEC_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "trtserve_spec_decode_drafts_total": ("Verify passes with drafts (one per request).", _spec(lambda d: d.drafts)),
    "trtserve_spec_decode_draft_tokens_total": ("Draft tokens proposed and verified.", _spec(lambda d: d.draft_tokens)),
    "trtserve_spec_decode_accepted_tokens_total": ("Draft tokens accepted.", _spec(lambda d: d.accepted_tokens)),
    "vllm:spec_decode_num_drafts_total": ("Number of spec decoding drafts (vLLM's name).", _spec(lambda d: d.drafts)),
    "vllm:spec_decode_num_draft_tokens_total": ("Number of draft tokens (vLLM's name).",
                                                _spec(lambda d: d.draft_tokens)),
    "vllm:spec_decode_num_accepted_tokens_total": ("Number of accepted tokens (vLLM's name).",
                                                   _spec(lambda d: d.accepted_tokens)),
}  # fmt: skip
# name -> (description, label, how to read {label value: value} from EngineStats)
SPEC_LABELLED_COUNTERS: dict[str, tuple[str, str, Callable[[EngineStats], dict[str, float]]]] = {
    "trtserve_spec_decode_accepted_tokens_per_position_total": ("Draft tokens accepted at each draft position.",
                                                                "position", _accepted_per_position),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": ("Accepted tokens per draft position (vLLM's name).",
                                                           "position", _accepted_per_position),
}  # fmt: skip


def _tiers(read: Callable[[TierStats], Any], none: Any = 0) -> Callable[[EngineStats], Any]:
    """Read the tiers' stats; `none` while the engine has no tiers (prefix caching off)."""
    return lambda s: read(s.kv_tiers) if s.kv_tiers is not None else none


# The KV cache's host and disk tiers (runtime/engine/kv_tiers/), exported while the engine has one.
TIER_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "trtserve_kv_tier_loads_total": (
        "Reads of blocks back from the tiers (one per admitted request).",
        _tiers(lambda t: t.loads),
    ),
    "trtserve_kv_tier_load_seconds_total": (
        "Copy thread time reading blocks back (latency: / loads).",
        _tiers(lambda t: t.load_seconds),
    ),
    "trtserve_kv_tier_stores_total": (
        "Copies of newly cached blocks to the tiers (one per step at most).",
        _tiers(lambda t: t.stores),
    ),
    "trtserve_kv_tier_store_seconds_total": ("Copy thread time storing blocks.", _tiers(lambda t: t.store_seconds)),
    "trtserve_kv_tier_rejected_files_total": (
        "Disk tier files refused: corrupt, truncated or another engine's.",
        _tiers(lambda t: t.rejected_files),
    ),
    "trtserve_kv_tier_write_errors_total": (
        "Disk tier writes that failed (a full disk, no permission).",
        _tiers(lambda t: t.write_errors),
    ),
}
TIER_LABELLED_COUNTERS: dict[str, tuple[str, str, Callable[[EngineStats], dict[str, float]]]] = {
    "trtserve_kv_tier_hits_total": (
        "Blocks read back from a tier instead of computed.",
        "tier",
        _tiers(lambda t: t.hits, {}),
    ),
    "trtserve_kv_tier_stored_blocks_total": ("Blocks written to a tier.", "tier", _tiers(lambda t: t.stored, {})),
    "trtserve_kv_tier_read_bytes_total": ("Bytes read back from a tier.", "tier", _tiers(lambda t: t.read_bytes, {})),
    "trtserve_kv_tier_written_bytes_total": ("Bytes written to a tier.", "tier", _tiers(lambda t: t.written_bytes, {})),
}
TIER_LABELLED_GAUGES: dict[str, tuple[str, str, Callable[[EngineStats], dict[str, float]]]] = {
    "trtserve_kv_tier_blocks": ("Blocks a tier keeps.", "tier", _tiers(lambda t: t.blocks, {})),
    "trtserve_kv_tier_usage_bytes": ("Bytes a tier keeps.", "tier", _tiers(lambda t: t.usage_bytes, {})),
    "trtserve_kv_tier_capacity_bytes": ("A tier's bound in bytes.", "tier", _tiers(lambda t: t.capacity_bytes, {})),
}


def _lora(read: Callable[[LoraStats], Any], none: Any = 0) -> Callable[[EngineStats], Any]:
    """Read the LoRA manager's stats; `none` without one."""
    return lambda s: read(s.lora) if s.lora is not None else none


# LoRA adapters (runtime/engine/lora_manager.py), exported while the engine serves them.
LORA_GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "trtserve_lora_adapters_registered": ("LoRA adapters served.", _lora(lambda s: len(s.registered))),
    "trtserve_lora_adapters_loaded": ("LoRA adapters in host memory.", _lora(lambda s: len(s.loaded))),
    "trtserve_lora_adapters_resident": ("LoRA adapters in a slot of the step.", _lora(lambda s: len(s.resident))),
}
LORA_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "trtserve_lora_disk_loads_total": ("LoRA adapters read from disk and checked.", _lora(lambda s: s.disk_loads)),
    "trtserve_lora_slot_loads_total": ("LoRA adapters paged into a slot.", _lora(lambda s: s.slot_loads)),
    "trtserve_lora_slot_evictions_total": (
        "LoRA adapters paged out of a slot for another.",
        _lora(lambda s: s.slot_evictions),
    ),
    "trtserve_lora_load_seconds_total": ("Time reading adapters and filling slots.", _lora(lambda s: s.load_seconds)),
}
LORA_LABELLED_COUNTERS: dict[str, tuple[str, str, Callable[[EngineStats], dict[str, float]]]] = {
    "trtserve_lora_requests_total": ("Requests admitted per LoRA adapter.", "adapter", _lora(lambda s: s.requests, {})),
    "trtserve_lora_generation_tokens_total": (
        "Tokens generated per LoRA adapter (counted as requests end).",
        "adapter",
        _lora(lambda s: s.tokens, {}),
    ),
}
LORA_LABELLED_GAUGES: dict[str, tuple[str, str, Callable[[EngineStats], dict[str, float]]]] = {
    # The gateway reads it: a request for a resident adapter prefers this replica (runtime/gateway/replicas.py).
    "trtserve_lora_resident": (
        "1 while a LoRA adapter is in a slot of the step, else 0.",
        "adapter",
        _lora(lambda s: {name: float(name in s.resident) for name in s.registered}, {}),
    ),
}
HISTOGRAMS = {
    "trtserve_time_to_first_token_seconds": ("Time to first token.", LATENCY_BUCKETS),
    "trtserve_inter_token_latency_seconds": ("Time between consecutive output tokens.", ITL_BUCKETS),
    "trtserve_queue_time_seconds": ("Time from arrival to first scheduling.", LATENCY_BUCKETS),
    "trtserve_e2e_request_latency_seconds": ("Time from arrival to the last token.", LATENCY_BUCKETS),
    "trtserve_step_duration_seconds": ("Engine step wall time (schedule, model, sample, detokenize).",
                                       list(STEP_TIME_BUCKETS)),
    "trtserve_prefill_tokens_per_step": ("Prompt tokens computed per engine step.", list(PREFILL_TOKEN_BUCKETS)),
    "trtserve_grammar_compile_seconds": ("Time to compile a distinct grammar (off the engine loop).",
                                         GRAMMAR_COMPILE_BUCKETS),
}  # fmt: skip


class TritonMetrics:
    def __init__(
        self,
        pb_utils: Any,
        labels: dict[str, str],
        speculative: bool = False,
        kv_tiers: bool = False,
        lora: bool = False,
    ) -> None:
        """`pb_utils`: Triton's triton_python_backend_utils module (untyped; only inside the stub).
        `speculative`: the engine speculates, so the SPEC_* families are exported too; `kv_tiers`: it has KV
        cache tiers, so the TIER_* ones too; `lora`: it serves LoRA adapters, so the LORA_* ones too."""
        kinds = pb_utils.MetricFamily
        self._families: list[Any] = []  # must outlive their metrics
        self._labels = labels

        def family(name: str, description: str, kind: Any) -> Any:
            self._families.append(kinds(name=name, description=description, kind=kind))
            return self._families[-1]

        self._gauge_reads = {**GAUGES, **(SPEC_GAUGES if speculative else {}), **(LORA_GAUGES if lora else {})}
        self._counter_reads = {
            **COUNTERS,
            **(SPEC_COUNTERS if speculative else {}),
            **(TIER_COUNTERS if kv_tiers else {}),
            **(LORA_COUNTERS if lora else {}),
        }
        self.gauges = {n: family(n, d, kinds.GAUGE).Metric(labels=labels) for n, (d, _) in self._gauge_reads.items()}
        self.counters = {
            n: family(n, d, kinds.COUNTER).Metric(labels=labels) for n, (d, _) in self._counter_reads.items()
        }
        # Labelled families: a metric per label value as values appear (draft positions, tiers, adapters).
        labelled_counters = {
            **(SPEC_LABELLED_COUNTERS if speculative else {}),
            **(TIER_LABELLED_COUNTERS if kv_tiers else {}),
            **(LORA_LABELLED_COUNTERS if lora else {}),
        }
        self._labelled = {
            n: (family(n, d, kinds.COUNTER), label, read, False) for n, (d, label, read) in labelled_counters.items()
        }
        labelled_gauges = {**(TIER_LABELLED_GAUGES if kv_tiers else {}), **(LORA_LABELLED_GAUGES if lora else {})}
        for n, (d, label, read) in labelled_gauges.items():
            self._labelled[n] = (family(n, d, kinds.GAUGE), label, read, True)
        self.labelled: dict[str, dict[str, Any]] = {n: {} for n in self._labelled}
        self.histograms = {
            n: family(n, d, kinds.HISTOGRAM).Metric(labels=labels, buckets=b) for n, (d, b) in HISTOGRAMS.items()
        }
        finished = family("trtserve_request_success_total", "Finished requests by finish reason.", kinds.COUNTER)
        self.finished = {
            reason: finished.Metric(labels={**labels, "finish_reason": reason}) for reason in FINISH_REASONS
        }
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._closed = False

    def observe_finished(self, out: RequestOutput) -> None:
        stats = out.stats
        with self._lock:
            if self._closed:
                return
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

    def update(self, stats: EngineStats, steps: Sequence[StepRecord] = (), compiles: Sequence[float] = ()) -> None:
        """Refresh gauges and counters from `stats`; observe `steps` (LLMEngine.take_step_records()) and grammar
        `compiles` (seconds: GrammarCache.take_compile_seconds())."""
        with self._lock:
            if self._closed:
                return
            for seconds in compiles:
                self.histograms["trtserve_grammar_compile_seconds"].observe(seconds)
            for step in steps:
                self.histograms["trtserve_step_duration_seconds"].observe(step.seconds)
                self.histograms["trtserve_prefill_tokens_per_step"].observe(step.prefill_tokens)
            for name, (_, read) in self._gauge_reads.items():
                self.gauges[name].set(float(read(stats)))
            for name, (_, read) in self._counter_reads.items():
                self._advance(self.counters[name], (name, ""), float(read(stats)))
            for name, (fam, label, read_labelled, gauge) in self._labelled.items():
                values, metrics = read_labelled(stats), self.labelled[name]
                for gone in metrics.keys() - values.keys() if gauge else ():  # an adapter unloaded: 0, not stale
                    metrics[gone].set(0.0)
                for value_label, value in values.items():
                    if value_label not in metrics:
                        metrics[value_label] = fam.Metric(labels={**self._labels, label: value_label})
                    if gauge:
                        metrics[value_label].set(float(value))
                    else:
                        self._advance(metrics[value_label], (name, value_label), float(value))

    def close(self) -> None:
        """Release every metric, then every family, now: their destructors message Triton through the stub's
        shared memory, which is gone by the time the interpreter would free them (the stub segfaulted at exit
        in Metric::SaveToSharedMemory). Observations after this are dropped."""
        with self._lock:
            self._closed = True
            for metrics in (self.gauges, self.counters, self.histograms, self.finished, *self.labelled.values()):
                metrics.clear()
            self._labelled.clear()  # holds families too
            self._families.clear()

    def _advance(self, counter: Any, key: tuple[str, str], value: float) -> None:
        """Increment `counter` to the engine's running total `value` (Triton counters only go up)."""
        last = self._last.get(key, 0.0)
        if value > last:
            counter.increment(value - last)
        self._last[key] = value

"""Latency targets at the serving edge, without a server: SamplingParams validation, the Triton
request inputs and model parameters, and the step / SLO metrics through a fake pb_utils."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from engine_format.requests import FIELD
from runtime import EngineArgs, InvalidRequest, SamplingParams
from runtime.engine.errors import Overloaded
from runtime.engine.stats import EngineStats, Histogram, StepRecord
from runtime.triton_model.inputs import parse_request
from runtime.triton_model.metrics import TritonMetrics
from runtime.triton_model.settings import model_settings

CONFIG = Path(__file__).parent.parent / "model_repository" / "llm" / "config.pbtxt"


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"ttft_target_s": 0}, "ttft_target_s", r"must be in \(0, inf\) \(got 0\)"),
        ({"itl_target_s": -0.1}, "itl_target_s", r"must be in \(0, inf\)"),
        ({"itl_target_s": float("inf")}, "itl_target_s", "must be a finite number"),
        ({"ttft_target_s": "1"}, "ttft_target_s", "must be a finite number"),
        ({"ttft_target_s": 2.0, "deadline_s": 1.0}, "ttft_target_s", r"must not exceed deadline_s \(2.0 > 1.0\)"),
    ],
)
def test_latency_targets_are_validated_with_the_field_named(params, field, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        SamplingParams(**params)
    assert info.value.field == field


def test_engine_args_itl_target():
    assert EngineArgs().itl_target_ms == 200.0 and EngineArgs(itl_target_ms=None).itl_target_ms is None
    assert EngineArgs(itl_target_ms=0).itl_target_ms is None  # 0: no target, as the setting's help says
    for bad in (-5.0, float("nan"), "150"):
        with pytest.raises(ValueError, match=r"EngineArgs\.itl_target_ms must be a positive number of ms or None"):
            EngineArgs(itl_target_ms=bad)
    with pytest.raises(ValueError, match=r"EngineArgs\.min_prefill_tokens must be a positive integer"):
        EngineArgs(min_prefill_tokens=0)


def test_triton_inputs_carry_the_targets_and_config_pbtxt_declares_them():
    parsed = parse_request({
        "text_input": np.array([b"hi"], dtype=np.object_),
        "ttft_target_s": np.array([0.5], dtype=np.float32),
        "itl_target_s": np.array([0.125], dtype=np.float32),
    })  # fmt: skip
    assert (parsed.params.ttft_target_s, parsed.params.itl_target_s) == (0.5, 0.125)
    with pytest.raises(InvalidRequest) as info:
        parse_request({"text_input": np.array([b"hi"], dtype=np.object_), "itl_target_s": np.array([0.0], np.float32)})
    assert info.value.field == "itl_target_s"
    config = CONFIG.read_text()
    declared = set(re.findall(r'\{ name: "(\w+)", data_type: TYPE_\w+', config))
    assert {"ttft_target_s", "itl_target_s"} <= declared and set(FIELD) <= declared
    settings = model_settings({"engine_dir": "e", "itl_target_ms": "none", "min_prefill_tokens": "32"})
    assert (settings.engine.itl_target_ms, settings.engine.min_prefill_tokens) == (None, 32)


def test_overloaded_keeps_its_message_prefix_reason_and_hint():
    exc = Overloaded("overloaded: x", retry_after_s=1.5, reason="slo")
    assert (str(exc), exc.retry_after_s, exc.reason) == ("overloaded: x", 1.5, "slo")
    assert (Overloaded("overloaded: y").reason, Overloaded("overloaded: y").retry_after_s) == ("queue_full", None)


class FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

    def increment(self, value):
        self.value += value

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.observed.append(value)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):  # pb_utils spells it so
        return FakeMetric(labels, buckets)


class FakePbUtils:
    MetricFamily = FakeFamily


def stats(**overrides) -> EngineStats:
    base = dict(running=0, waiting=0, kv_usage=0.0, kv_blocks={"free": 1, "cached": 0, "used": 0},
                prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0, prompt_tokens=0, generation_tokens=0,
                steps=0, finished={}, rejected_overloaded=0, rejected_invalid=0)  # fmt: skip
    return EngineStats(**{**base, **overrides})


def test_triton_metrics_observe_steps_and_count_slo_attainment():
    metrics = TritonMetrics(FakePbUtils, {"model": "llm", "version": "1"})
    steps = [StepRecord(0.12, 0.11, 64, 8, 72), StepRecord(0.04, 0.05, 0, 8, 72)]
    metrics.update(stats(rejected_slo=2, slo={"ttft_met": 3, "itl_missed": 1}, step_token_budget=72), steps)
    metrics.update(stats(rejected_slo=2, slo={"ttft_met": 5, "ttft_missed": 1, "itl_missed": 1}, step_token_budget=40))
    assert metrics.histograms["trtserve_step_duration_seconds"].observed == [0.12, 0.04]
    assert metrics.histograms["trtserve_prefill_tokens_per_step"].observed == [64, 0]
    assert metrics.gauges["trtserve_step_token_budget"].value == 40
    counted = {name: metrics.counters[name].value for name in metrics.counters if "slo" in name}
    assert counted == {
        "trtserve_requests_rejected_slo_total": 2,
        "trtserve_ttft_slo_met_total": 5,
        "trtserve_ttft_slo_missed_total": 1,
        "trtserve_itl_slo_met_total": 0,
        "trtserve_itl_slo_missed_total": 1,
    }


def test_histogram_buckets_are_upper_bounds():
    histogram = Histogram((0, 16, 64))
    for value in (0, 1, 16, 17, 64, 65, 1000):
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert (snapshot.counts, snapshot.count, snapshot.total) == ((1, 2, 2, 2), 7, 1163.0)

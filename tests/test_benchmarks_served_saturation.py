"""The served-saturation benchmark's arithmetic: steady-state rates between two /metrics samples, and its report."""

from __future__ import annotations

import pytest

from benchmarks.served_saturation import Sample, render, steady_state


def test_steady_state_is_the_counters_difference_over_the_window():
    before = Sample(time_s=100.0, generation_tokens=5_000, step_seconds=40.0, steps=1_000)
    after = Sample(time_s=130.0, generation_tokens=5_000 + 21_600, step_seconds=40.0 + 28.5, steps=1_000 + 675)
    result = steady_state(before, after)
    assert result == pytest.approx(
        {"output_tok_s": 720.0, "ms_per_step": 1000 * 28.5 / 675, "busy": 0.95, "tokens_per_step": 32.0}
    )


@pytest.mark.parametrize("later", [0.0, 30.0])
def test_a_window_without_steps_is_refused(later):
    before = Sample(time_s=100.0, generation_tokens=0, step_seconds=0.0, steps=10)
    with pytest.raises(ValueError, match="no steps in the window"):
        steady_state(before, Sample(100.0 + later, 0, 0.0, 10))


def test_report_compares_each_configuration_with_the_first():
    streamed = {"output_tok_s": 700.0, "ms_per_step": 43.0, "busy": 0.95, "tokens_per_step": 32.0}
    whole = {"output_tok_s": 770.0, "ms_per_step": 39.4, "busy": 0.94, "tokens_per_step": 32.0}
    runs = {"streamed": [streamed, {**streamed, "output_tok_s": 680.0}], "whole": [whole, whole]}
    payload = {"machine": {"cpu": "x", "cores": 2}, "date_utc": "-", "command": "c", "workload": "w", "repetitions": 2,
               "runs": runs}  # fmt: skip
    lines = render(payload).splitlines()
    assert lines[-2] == "| streamed | 690 (680–700) | 43.0 | 0.950 | 32.0 | 1.00x |"
    assert lines[-1] == "| whole | 770 (770–770) | 39.4 | 0.940 | 32.0 | 1.12x |"

"""benchmarks.decode_profile_vllm without vLLM: its report's host column is the step less its timed parts, and a
run asked for where vLLM is not installed says how to install it (the runner itself needs vLLM's venv)."""

from __future__ import annotations

import click
import pytest

from benchmarks import decode_profile_vllm


def payload(attention_timed: bool = True) -> dict:
    parts = {"model": 49.8, "attention": 7.3, "sampling": 0.2, "scheduler": 0.5}
    row = {"batch": 16, "context": 100, "running": 16, "step_ms": 60.8, "step_ms_min": 59.9, "step_ms_max": 68.1}
    row["parts_ms"] = parts
    return {"command": "x", "vllm": "0.32.0", "dtype": "float32", "attention_timed": attention_timed, "rows": [row]}


def test_the_host_column_is_the_step_less_its_parts():
    markdown = decode_profile_vllm.render(payload())
    assert "| 16 x 100 | 16 | 60.8 (59.9-68.1) | 49.8 | 7.3 | 0.2 | 0.5 | 10.3 |" in markdown


def test_attention_that_was_not_timed_is_not_reported_as_zero():
    assert "not separable" in decode_profile_vllm.render(payload(attention_timed=False))


def test_without_vllm_it_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(decode_profile_vllm, "VENVS", tmp_path)
    with pytest.raises(click.ClickException, match=r"setup\.sh vllm"):
        decode_profile_vllm.run([1], [100], 3, "float32")

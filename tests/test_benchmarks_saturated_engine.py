"""The saturated-engine benchmark on the tiny engine: speculation off and n-gram both run closed-loop
and report what they emitted; the report compares them to the first configuration."""

from __future__ import annotations

from benchmarks.saturated_engine import render, run_config
from tests.helpers import NEEDS_BF16_MATMUL

SHORT = {"system_len": 40, "turn_mean": 16, "answer_range": (8, 24)}


@NEEDS_BF16_MATMUL
def test_off_and_ngram_run_saturated_and_are_reported(llama_engine):
    off = run_config(llama_engine, "cpu-bf16", 0, outstanding=10, warmup=2, steps=12, **SHORT)
    ngram = run_config(llama_engine, "cpu-bf16", 3, outstanding=10, warmup=2, steps=12, **SHORT)
    for result in (off, ngram):
        assert result["output_tok_s"] > 0 and result["ms_per_step"] > 0 and result["attention_ms_per_step"] > 0
    assert off["acceptance"] is None and 0.0 <= ngram["acceptance"] <= 1.0
    payload = {"machine": {"cpu": "x", "cores": 2}, "date_utc": "-", "command": "c", "workload": "w", "repetitions": 1,
               "runs": {"speculation off": [off], "n-gram speculation, k = 3": [ngram]}}  # fmt: skip
    lines = render(payload).splitlines()
    assert lines[-2].startswith("| speculation off |") and lines[-2].endswith("| 1.00x |")
    ratio = ngram["output_tok_s"] / off["output_tok_s"]
    assert lines[-1].endswith(f"| {ratio:.2f}x |")

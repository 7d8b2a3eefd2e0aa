"""The host-path benchmarks at toy size: benchmarks.served_path (AsyncLLM as served over a simulated device) and
benchmarks.host_step_ab's worker (LLMEngine.step over random tokens), on the tiny engine. They check what each
reports adds up, not how fast it is (timing is the benchmarks' business, not the tests')."""

from __future__ import annotations

import statistics

import pytest

from benchmarks import host_step_ab, pack_rows, served_path


@pytest.mark.parametrize("engine_process", [False, True], ids=["core-in-a-thread", "core-in-a-process"])
def test_served_path_reports_each_part_and_the_device_share(llama_engine, engine_process):
    row = served_path.measure(
        llama_engine, batch=4, device_ms=1.0, steps=8, engine_process=engine_process, prompt_tokens=32
    )
    assert row["steps"] == 8 and row["step_ms"] > 0, row
    assert 0.0 < row["device_busy"] <= 1.0
    for part in ("engine_core_us", "output_thread_us", "event_loop_us"):
        assert row[part] > 0, (part, row)
    assert row["backend_us"] >= 0 and row["step_interval_p50_ms"] <= row["step_interval_p99_ms"]
    assert set(row["cpu_us"]) == {"engine", "outputs", "event_loop"} and row["cpu_us"]["engine"] > 0, row
    markdown = served_path.render({"command": "x", "rows": [row]})
    assert f"| 4 | 1.0 | {'process' if engine_process else 'thread'} | 1 |" in markdown


def test_host_step_worker_steps_every_request_each_step(llama_engine):
    for backend in ("null", "torch"):
        result = host_step_ab.worker(str(llama_engine), 4, 8, backend, prompt_tokens=32)
        assert len(result["step_s"]) == len(result["backend_s"]) == 8
        assert statistics.median(result["backend_s"]) < statistics.median(result["step_s"])


def test_pack_rows_times_both_ways():
    row = pack_rows.time_pack(batch=4, context=64, block_size=16, repetitions=2)
    assert row["every_table_us"] > 0 and row["rows_us"] > 0

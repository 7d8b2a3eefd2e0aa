"""The step profile (benchmarks/step_profile.py) on the tiny engine: each part of a step timed once
(the parts never add up past the step's wall time), the engine restored afterwards, and the FLOP count
its GFLOP/s figures use equal to the MatMul weights of the segment it times."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from benchmarks import step_profile
from benchmarks.datasets import mixed
from engine_format.files import segment_file
from executors.kv_pool import KVPool
from runtime import EngineArgs, LLMEngine
from runtime.engine.detokenizer import DetokenizedStream


@pytest.fixture(scope="module")
def engine(llama_engine) -> LLMEngine:
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=64, itl_target_ms=None, backend="cpu")
    return LLMEngine(llama_engine, args)


def test_every_part_of_a_step_is_timed_once_and_the_engine_is_restored(engine):
    requests = iter(mixed(engine.tokenizer, 60, seed=1, system_len=40, turn_mean=20, answer_range=(4, 9)))
    records = step_profile.saturated_steps(engine, requests, outstanding=6, warmup=2, steps=20)
    assert len(records) == 20 and max(r["decode_seqs"] for r in records) == 4
    for record in records:
        parts = record["parts_s"]
        assert set(parts) == set(step_profile.PARTS)
        assert parts["python_other"] >= 0  # a part timed inside another would push the sum past the wall
        assert min(parts[p] for p in ("ort_first", "ort_layers", "ort_last_lm_head", "attention_kernel")) > 0
    shares = [p["share"] for p in step_profile.breakdown(records)["parts"].values()]
    assert sum(shares) == pytest.approx(1.0, abs=1e-3)
    assert KVPool.write.__name__ == "write" and DetokenizedStream.add.__name__ == "add"
    assert engine.backend.segments[0].run.__name__ == "run" and engine.check_invariants() is None


def test_the_flop_count_is_the_segment_s_matmul_weights(engine):
    config = engine.config
    segment = onnx.load(str(config.engine_dir / segment_file(config.model.num_layers // 2)))
    weights = {t.name: numpy_helper.to_array(t) for t in segment.graph.initializer}
    matmul_params = sum(weights[n.input[1]].size for n in segment.graph.node if n.op_type == "MatMul"
                        and n.input[1] in weights)  # fmt: skip
    assert matmul_params > 0
    assert step_profile.layer_flops_per_token(engine) == 2 * matmul_params
    rows = step_profile.gemm_efficiency(engine, [1, 4], repeats=2)
    assert {r["tokens"] for r in rows} == {1, 4} and all(r["ms"] > 0 and r["gflops"] > 0 for r in rows)
    assert np.isfinite([r["gflops"] for r in rows]).all()

"""SmolLM2-135M quantized to INT4-AWQ through build-engine, behind the real gate (gate_v1.json).

The build calibrates on the packaged text, exports the Q/DQ graph, verifies it against the HF
model holding the same quantized weights, and gates it against the unquantized engine on the
held-out set. Here: the gate passed with real margins, the manifest records what TensorRT and
an auditor need, the runtime answers with the quantized engine, and a corrupted copy fails the
same gate (so the pass is not vacuous).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder.build import BuildOptions, build_engine
from calibration.data import DataConfig, load_text_sets
from calibration.gate import run_gate
from engine_format import EngineConfig
from runtime import LLM, SamplingParams
from tests.helpers import corrupt_scales

# The fixture's build calibrates, quantizes and gates the real model: ~5 minutes on 2 idle cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
MAX_SEQ_LEN = 1024


@pytest.fixture(scope="module")
def int4_engine(engines_dir: Path) -> Path:
    out = engines_dir / "smollm2-135m-int4-awq"
    if not out.exists():
        build_engine(BuildOptions("smollm2-135m", out, max_batch_size=8, max_seq_len=MAX_SEQ_LEN, quantize="int4-awq"))
    return out


def test_int4_awq_passes_the_gate(int4_engine, smollm2_engine):
    manifest = json.loads((int4_engine / "manifest.json").read_text())
    record = manifest["quantization"]
    assert record["gate"] == {"passed": True, "overridden": False, "report": "gate_report.json",
                              "gate_config_version": 1}  # fmt: skip
    report = json.loads((int4_engine / "gate_report.json").read_text())
    checks, metrics = report["checks"], report["metrics"]
    assert all(c["passed"] for c in checks.values())
    # The gate measured a real model: the reference answers its known questions and the
    # quantized engine stays close to it.
    assert metrics["reference_correct"] >= 5 and metrics["heldout_tokens"] >= 32 * 255
    assert 0 < metrics["mean_kl"] < 0.15 and metrics["top1_agreement"] > 0.8
    data = record["calibration_data"]
    assert data["calibration_sequences"] == 64 and data["heldout_sequences"] == 32
    assert data["calibration_sha256"] != data["heldout_sha256"]
    size = lambda d: (d / "model.onnx.data").stat().st_size  # noqa: E731
    assert size(int4_engine) < 0.5 * size(smollm2_engine)


def test_int4_awq_engine_answers(int4_engine):
    llm = LLM(int4_engine)
    [out] = llm.generate(
        [[{"role": "user", "content": "What is the capital of France?"}]], SamplingParams(temperature=0, max_tokens=16)
    )
    assert "Paris" in out.text, out.text


def test_corrupted_int4_engine_fails_the_gate(int4_engine, smollm2_engine, smollm2_hf, tmp_path):
    """The same gate, on a copy whose INT4 scales are off by 2x: the check must trip."""
    broken = tmp_path / "broken"
    shutil.copytree(int4_engine, broken)
    corrupt_scales(broken, 2.0)
    _, tokenizer = smollm2_hf
    texts = load_text_sets(tokenizer, DataConfig(heldout_samples=8, calibration_samples=2))
    reference = EngineConfig.load(smollm2_engine)
    report = run_gate(reference, EngineConfig.load(broken), texts, tokenizer)
    assert not report.passed, report.table()
    assert not report.checks["perplexity_increase"]["passed"] and not report.checks["mean_kl"]["passed"]

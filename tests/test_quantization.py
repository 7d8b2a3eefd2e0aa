"""Quantization: number formats, AWQ, the Q/DQ structure TensorRT needs, the runtime on
quantized engines, calibration data, and the quality gate (which must be able to fail)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, numpy_helper

from builder.build import BuildOptions, build_engine
from builder.cli import main as build_cli
from builder.sources import load_checkpoint, resolve_model
from calibration import awq
from calibration.data import DataConfig, load_text_sets
from calibration.gate import run_gate
from calibration.gptq import gptq_int4
from calibration.linears import fused_weight, linear_groups
from calibration.numerics import block_amax, fp8_dequantize, fp8_quantize, int4_dequantize, int4_quantize
from engine_format import EngineConfig
from runtime import LLM, SamplingParams
from tests.conftest import TINY_BLOCK_SIZE, TINY_MAX_SEQ_LEN
from tests.helpers import corrupt_scales

SMALL_DATA = DataConfig(calibration_samples=8, heldout_samples=4, seq_len=64)


def _permissive_gate(tmp_path: Path) -> Path:
    """Tiny random models have near-uniform predictions: their gate numbers mean nothing, so
    these builds use a gate that only exercises the mechanics."""
    loose = {"max_perplexity_increase": 10.0, "max_mean_kl": 10.0, "min_top1_agreement": 0.0,
             "min_answer_retention": 0.0}  # fmt: skip
    path = tmp_path / "gate.json"
    path.write_text(json.dumps({"version": 0, "thresholds": dict.fromkeys(("fp8", "int4-awq", "int4-rtn"), loose)}))
    return path


def _build_quantized(name: str, method: str, out: Path, gate: Path, **extra) -> dict:
    options = BuildOptions(
        model=name, output=out, max_batch_size=8, max_seq_len=TINY_MAX_SEQ_LEN, block_size=TINY_BLOCK_SIZE,
        quantize=method, calibration=SMALL_DATA, gate_config=gate, **extra,
    )  # fmt: skip
    return build_engine(options)


@pytest.fixture(scope="module")
def quantized_engines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    gate = _permissive_gate(root)
    engines = {}
    for name, method in (("tiny-llama", "int4-awq"), ("tiny-qwen2", "int4-rtn"), ("tiny-llama", "fp8")):
        engines[f"{name}:{method}"] = out = root / f"{name}-{method}"
        _build_quantized(name, method, out, gate)
    return engines


# ---- number formats and AWQ ---------------------------------------------------------------


def test_int4_matches_independent_numpy_reference():
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    q, scales = int4_quantize(w, 32)
    blocks = w.numpy().reshape(6, 2, 32)
    want_scales = np.abs(blocks).max(-1) / 7
    want_q = np.clip(np.rint(blocks / want_scales[..., None]), -8, 7).reshape(6, 64)
    np.testing.assert_allclose(scales.numpy(), want_scales, rtol=1e-6)
    np.testing.assert_array_equal(q.numpy(), want_q)
    error = (int4_dequantize(q, scales) - w).abs().reshape(6, 2, 32)
    assert (error <= scales[..., None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="not a multiple of the INT4 block size"):
        int4_quantize(w, 48)


def test_fp8_round_trip_is_within_e4m3_precision():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    q, scales = fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn
    relative = ((fp8_dequantize(q, scales) - w).abs() / w.abs().amax(1, keepdim=True)).max()
    assert 0 < relative < 2**-4  # 3 mantissa bits


def test_awq_beats_round_to_nearest_with_outlier_channels():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=gen)
    x = torch.randn(256, 128, generator=gen)
    x[:, :4] *= 30  # a few salient input channels, as in real activations
    reference = x @ w.T
    rtn_error = (x @ int4_dequantize(*int4_quantize(w, 32)).T - reference).pow(2).mean()
    scale, ratio = awq.search_scale(w, x, x.abs().mean(0), 32)
    amax = awq.search_clip(w * scale, x / scale, 32)
    awq_error = ((x / scale) @ int4_dequantize(*int4_quantize(w * scale, 32, amax)).T - reference).pow(2).mean()
    assert ratio > 0 and awq_error < 0.7 * rtn_error


def test_gptq_rounding_lowers_output_error_on_the_same_scales():
    """Same scales, different codes: GPTQ's error feedback must beat nearest rounding on the
    output error of correlated inputs (what real activations are), and stay a valid INT4 code."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 128, generator=gen)
    mix = torch.randn(128, 128, generator=gen) / 8 + torch.eye(128)
    x = torch.randn(2048, 128, generator=gen) @ mix  # correlated input channels
    amax = block_amax(w, 32)
    q_near, s_near = int4_quantize(w, 32, amax)
    q_gptq, s_gptq = gptq_int4(w, x.T @ x / x.shape[0], 32, amax)
    torch.testing.assert_close(s_gptq, s_near)
    assert q_gptq.dtype == torch.int8 and q_gptq.min() >= -8 and q_gptq.max() <= 7
    assert (q_gptq != q_near).float().mean() > 0.05  # it did re-round

    def output_error(q, s):
        return float((x @ int4_dequantize(q, s).T - x @ w.T).pow(2).mean())

    assert output_error(q_gptq, s_gptq) < 0.8 * output_error(q_near, s_near)
    # An input channel that is never active gets no weight (its H row is empty).
    x[:, 5] = 0
    q_dead, _ = gptq_int4(w, x.T @ x / x.shape[0], 32, amax)
    assert (q_dead[:, 5] == 0).all()


def test_awq_scale_folding_keeps_the_fp32_function():
    """Folding s into the producer and s into the weights is exact before rounding."""
    from calibration.quantize import _apply_awq_scale

    model, _ = load_checkpoint(resolve_model("tiny-qwen2"))  # MHA + QKV bias: every group folds
    tokens = torch.tensor([list(range(5, 45))])
    with torch.no_grad():
        before = model(tokens).logits
        for group in linear_groups_of(model):
            if group.scale_sink:
                x = torch.randn(64, fused_weight(model, group).shape[1])
                _apply_awq_scale(model, group, x, x.abs().mean(0) + torch.rand(x.shape[1]), 32)
        after = model(tokens).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def linear_groups_of(model):
    from builder.hf_config import model_spec_from_hf_config

    return linear_groups(model_spec_from_hf_config(model.config))


# ---- the Q/DQ graph TensorRT consumes ------------------------------------------------------


def _nodes(engine: Path) -> tuple[list[onnx.NodeProto], dict[str, onnx.TensorProto]]:
    model = onnx.load(engine / "model.onnx", load_external_data=False)
    return list(model.graph.node), {t.name: t for t in model.graph.initializer}


def test_int4_graph_structure(quantized_engines):
    nodes, inits = _nodes(quantized_engines["tiny-llama:int4-awq"])
    producers = {o: n for n in nodes for o in n.output}
    matmuls = [n for n in nodes if n.op_type == "MatMul" and n.name.endswith("_proj")]
    assert len(matmuls) == 4 * 2  # qkv, o, gate_up, down per layer
    for matmul in matmuls:
        dq = producers[matmul.input[1]]
        assert dq.op_type == "DequantizeLinear"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
        assert attrs == {"axis": 0, "block_size": 32}
        weight, scale = inits[dq.input[0]], inits[dq.input[1]]
        assert weight.data_type == TensorProto.INT4 and scale.data_type == TensorProto.FLOAT
        assert list(scale.dims) == [weight.dims[0] // 32, weight.dims[1]]
        assert len(dq.input) == 2  # no zero point: 0, as TensorRT requires
    # Embedding and lm_head stay unquantized.
    lm_head = next(n for n in nodes if n.name == "lm_head")
    assert inits[lm_head.input[1]].data_type == TensorProto.FLOAT
    assert not any(n.op_type == "QuantizeLinear" for n in nodes)  # weight-only


def test_fp8_graph_structure(quantized_engines):
    nodes, inits = _nodes(quantized_engines["tiny-llama:fp8"])
    producers = {o: n for n in nodes for o in n.output}
    for matmul in (n for n in nodes if n.op_type == "MatMul" and n.name.endswith("_proj")):
        act_dq, weight_dq = producers[matmul.input[0]], producers[matmul.input[1]]
        assert weight_dq.op_type == "DequantizeLinear" and act_dq.op_type == "DequantizeLinear"
        weight, scale = inits[weight_dq.input[0]], inits[weight_dq.input[1]]
        assert weight.data_type == TensorProto.FLOAT8E4M3FN
        assert onnx.helper.get_attribute_value(weight_dq.attribute[0]) == 1 and list(scale.dims) == [weight.dims[1]]
        act_q = producers[act_dq.input[0]]
        assert act_q.op_type == "QuantizeLinear"
        assert inits[act_q.input[2]].data_type == TensorProto.FLOAT8E4M3FN
        assert list(inits[act_q.input[1]].dims) == []  # per-tensor activation scale
        assert numpy_helper.to_array(inits[act_q.input[1]]) > 0


# ---- the runtime serves quantized engines ------------------------------------------------


@pytest.mark.parametrize("key", ["tiny-llama:int4-awq", "tiny-qwen2:int4-rtn", "tiny-llama:fp8"])
def test_runtime_serves_quantized_engine(quantized_engines, key):
    engine = quantized_engines[key]
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["quantization"]["method"] == key.split(":")[1]
    assert manifest["quantization"]["calibration_data"]["calibration_sha256"]
    verification = manifest["verification"]
    assert max(verification["backends"]["cpu"]["max_abs_error"].values()) <= verification["tolerance"]
    assert (engine / "gate_report.json").is_file() and (engine / "gate_report.md").is_file()
    llm = LLM(engine)
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12, 12]


def test_int4_engine_is_smaller(quantized_engines, llama_engine):
    size = lambda d: (d / "model.onnx.data").stat().st_size  # noqa: E731
    assert size(quantized_engines["tiny-llama:int4-awq"]) < size(llama_engine)


# ---- calibration data ----------------------------------------------------------------------


def test_calibration_and_heldout_are_disjoint_and_seeded():
    _, tokenizer = load_checkpoint(resolve_model("tiny-llama"))
    a = load_text_sets(tokenizer, SMALL_DATA)
    assert len(a.calibration) == 8 and len(a.heldout) == 4
    assert all(len(s) == 64 for s in a.calibration + a.heldout)
    assert not {tuple(s) for s in a.calibration} & {tuple(s) for s in a.heldout}
    assert load_text_sets(tokenizer, SMALL_DATA).record == a.record
    other = load_text_sets(tokenizer, DataConfig(8, 4, 64, seed=1))
    assert other.record["calibration_sha256"] != a.record["calibration_sha256"]
    assert "chatterbot-corpus" in a.record["sources"]["chat"]


# ---- the gate ------------------------------------------------------------------------------


def gate_reference(engine: Path, model_name: str, tmp_path: Path) -> EngineConfig:
    """The unquantized engine of the same model and limits, to gate against."""
    out = tmp_path / "reference"
    build_engine(BuildOptions(model_name, out, 8, TINY_MAX_SEQ_LEN, TINY_BLOCK_SIZE))
    return EngineConfig.load(out)


def test_gate_catches_corrupted_scales(quantized_engines, tmp_path):
    engine = tmp_path / "int4"
    shutil.copytree(quantized_engines["tiny-llama:int4-awq"], engine)
    reference = gate_reference(engine, "tiny-llama", tmp_path)
    _, tokenizer = load_checkpoint(resolve_model("tiny-llama"))
    texts = load_text_sets(tokenizer, SMALL_DATA)
    strict = tmp_path / "strict.json"
    limits = {"max_perplexity_increase": 0.2, "max_mean_kl": 0.2, "min_top1_agreement": 0, "min_answer_retention": 0}
    strict.write_text(json.dumps({"version": 0, "thresholds": {"int4-awq": limits}}))
    good = run_gate(reference, EngineConfig.load(engine), texts, tokenizer, strict)
    corrupt_scales(engine, 4.0)
    bad = run_gate(reference, EngineConfig.load(engine), texts, tokenizer, strict)
    assert good.passed, good.table()
    assert not bad.passed and not bad.checks["mean_kl"]["passed"], bad.table()
    assert bad.metrics["mean_kl"] > 5 * good.metrics["mean_kl"]


def test_failed_gate_exits_nonzero_and_keeps_previous_engine(llama_engine, tmp_path):
    out = tmp_path / "engine"
    shutil.copytree(llama_engine, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    impossible = tmp_path / "impossible.json"
    limits = {"max_perplexity_increase": -1, "max_mean_kl": 0, "min_top1_agreement": 1, "min_answer_retention": 1}
    impossible.write_text(json.dumps({"version": 9, "thresholds": {"int4-rtn": limits}}))
    args = ["--model", "tiny-llama", "--output", str(out), "--max-seq-len", "256", "--block-size", "8",
            "--quantize", "int4-rtn", "--calib-samples", "8", "--heldout-samples", "4",
            "--gate-config", str(impossible)]  # fmt: skip
    result = CliRunner().invoke(build_cli, args)
    assert result.exit_code == 1 and "quality gate failed" in result.output and "FAIL" in result.output
    assert "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    evidence = json.loads((tmp_path / "engine.gate-failed.json").read_text())
    assert not evidence["passed"] and len(evidence["metrics"]["answers"]) == evidence["metrics"]["questions"]
    result = CliRunner().invoke(build_cli, [*args, "--accept-gate-failure"])
    assert result.exit_code == 0, result.output
    gate = json.loads((out / "manifest.json").read_text())["quantization"]["gate"]
    assert gate == {"passed": False, "overridden": True, "report": "gate_report.json", "gate_config_version": 9}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quantize", "int8"], "'int8' is not one of"),
        (["--quantize", "int4-awq", "--int4-block-size", "48"], "--int4-block-size must be one of"),
        (["--quantize", "int4-awq", "--int4-block-size", "128"], "does not divide the model's hidden_size (64)"),
    ],
)
def test_bad_quantization_options_are_named(tmp_path, args, message):
    base = ["--model", "tiny-llama", "--output", str(tmp_path / "e"), "--max-seq-len", "256", "--block-size", "8"]
    result = CliRunner().invoke(build_cli, [*base, *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "e").exists()


def test_trtserve_calibrate_regates_an_engine(quantized_engines, llama_engine, tmp_path):
    from runtime.cli import main as trtserve

    engine = tmp_path / "int4"
    shutil.copytree(quantized_engines["tiny-llama:int4-awq"], engine)
    (engine / "gate_report.json").unlink()
    result = CliRunner().invoke(
        trtserve, ["calibrate", "--engine", str(engine), "--gate-config", str(_permissive_gate(tmp_path))]
    )
    assert result.exit_code == 0 and "PASSED" in result.output, result.output
    assert json.loads((engine / "gate_report.json").read_text())["passed"]
    result = CliRunner().invoke(trtserve, ["calibrate", "--engine", str(llama_engine)])
    assert result.exit_code == 1 and "is not a quantized engine" in result.output

"""--quantize-lm-head: the output projection in INT4 too (a tied one as its own copy), for draft engines.
The head's codes are checked against a numpy round-to-nearest of the fp32 engine's table, which the
embedding lookup must still read unchanged; both INT4 methods build (the exporter's verification
against the fake-quantized HF model passes) and serve, on the ONNX Runtime and torch backends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from builder.build import BuildOptions
from builder.errors import BuildError
from engine_format import EngineConfig
from executors.torch.weights import load_weights
from runtime import LLM, SamplingParams
from tests.test_quantization import _build_quantized, _nodes, _permissive_gate

BLOCK = 32


@pytest.fixture(scope="module")
def head_engines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm-head")
    gate = _permissive_gate(root)
    engines = {}
    for method in ("int4-rtn", "int4-awq"):
        engines[method] = out = root / f"tiny-llama-{method}-head"
        _build_quantized("tiny-llama", method, out, gate, quantize_lm_head=True)
    return engines


def _array(engine: Path, tensor: onnx.TensorProto) -> np.ndarray:
    return numpy_helper.to_array(tensor, base_dir=str(engine)).astype(np.float32)


def dequantized_head(engine: Path) -> np.ndarray:
    """The head's INT4 weight [hidden, vocab] as DequantizeLinear computes it (zero point 0)."""
    nodes, inits = _nodes(engine)
    producers = {o: n for n in nodes for o in n.output}
    head = next(n for n in nodes if n.name == "lm_head")
    assert head.op_type == "MatMul"
    dq = producers[head.input[1]]
    assert dq.op_type == "DequantizeLinear" and inits[dq.input[0]].data_type == TensorProto.INT4
    codes, scales = _array(engine, inits[dq.input[0]]), _array(engine, inits[dq.input[1]])
    assert codes.min() >= -8 and codes.max() <= 7
    return codes * np.repeat(scales, BLOCK, axis=0)


def test_the_head_is_int4_round_to_nearest_and_the_embedding_stays_float(head_engines, llama_engine):
    engine = head_engines["int4-rtn"]
    reference = _array(llama_engine, _nodes(llama_engine)[1]["embed_tokens"])  # [vocab, hidden] fp32
    assert np.array_equal(_array(engine, _nodes(engine)[1]["embed_tokens"]), reference)  # the lookup's table
    head = dequantized_head(engine)
    assert head.shape == reference.T.shape
    blocks = reference.T.reshape(-1, BLOCK, reference.shape[0])  # [hidden / 32, 32, vocab]
    step = np.repeat(np.abs(blocks).max(axis=1) / 7, BLOCK, axis=0)  # symmetric INT4: amax / 7 per block
    assert np.all(np.abs(head - reference.T) <= step / 2 + 1e-6)
    assert np.abs(head - reference.T).max() > 0  # quantized, not copied


def test_a_broken_head_is_caught_by_the_reference_check(head_engines, llama_engine):
    reference = _array(llama_engine, _nodes(llama_engine)[1]["embed_tokens"])
    broken = dequantized_head(head_engines["int4-rtn"]) * 1.5
    step = np.abs(reference).max() / 7
    assert np.abs(broken - reference.T).max() > step / 2


@pytest.mark.parametrize("method", ["int4-rtn", "int4-awq"])
def test_engines_with_an_int4_head_record_it_and_serve(head_engines, method):
    engine = head_engines[method]
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["quantization"]["excluded"] == ["embed_tokens"]
    verification = manifest["verification"]
    assert max(verification["backends"]["cpu"]["max_abs_error"].values()) <= verification["tolerance"]
    outs = LLM(engine).generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(outs[0].token_ids) == 8
    weights = load_weights(EngineConfig.load(engine), torch.device("cpu"), torch.float32)  # the torch backend's
    np.testing.assert_allclose(weights.lm_head.numpy(), dequantized_head(engine).T, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", [None, "fp8"])
def test_the_head_needs_an_int4_method(method, tmp_path):
    with pytest.raises(BuildError, match="--quantize-lm-head needs --quantize int4-awq or int4-rtn"):
        BuildOptions("tiny-llama", tmp_path / "engine", quantize=method, quantize_lm_head=True).validate()

"""A quantized KV cache (int8/fp8) through the ONNX graphs: the portable graph (`graph` backend) and
the plugin graph run through its reference bodies (`plugin` backend) quantize this step's rows in
the graph and read the pool's codes in place, storing exactly the bytes the CPU backend stores.
Tiny random-weight models; the encodings are checked bit for bit against executors/kv_quant.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from builder.build import BuildOptions, build_engine
from builder.errors import BuildError
from builder.kv_onnx import decode_fp8, encode_fp8, quantize_int8
from builder.onnx_graph import GraphBuilder
from builder.plugin_functions_kv import QUANTIZED_OPS
from calibration.data import DataConfig
from engine_format import EngineConfig
from engine_format.files import PLUGIN_GRAPH_FILE
from executors import create_backend
from executors.base import SequenceChunk
from executors.kv_quant import decode_fp8 as np_decode_fp8
from executors.kv_quant import encode_fp8 as np_encode_fp8
from executors.kv_quant import quantize_int8 as np_quantize_int8
from tests.conftest import TINY_BLOCK_SIZE, TINY_MAX_SEQ_LEN
from tests.helpers import random_prompts

LOOSE = {"max_perplexity_increase": 10.0, "max_mean_kl": 10.0, "min_top1_agreement": 0.0, "min_answer_retention": 0.0}
# Same model, same stored codes: the graph and the CPU kernel differ only in float summation order
# (and in the rare code a last-ulp different K/V row rounds the other way).
LOGITS_TOLERANCE = 1e-4


def _edge_values(rng: np.random.Generator) -> np.ndarray:
    """Rows of 4 heads x 8: random magnitudes, exact rounding ties, zeros and -0, a whole zero head."""
    rows = (rng.standard_normal((64, 32)) * np.exp2(rng.integers(-12, 10, (64, 1)))).astype(np.float32)
    rows[0, :8] = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 63.5, -63.5]  # absmax 127: codes are the values, ties
    rows[1, :8] = 0.0
    rows[2, 8:16] = -0.0
    rows[3] = np.linspace(-600, 600, 32)  # past fp8's 448 (scale 1): saturates
    return rows


def _run(build, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    g = GraphBuilder("kv_codec")
    names = {name: g.input(name, elem, list(array.shape)) for name, (array, elem) in inputs.items()}
    outputs = build(g, names)
    for name, elem in outputs:
        g.output(name, elem, None)  # type: ignore[arg-type]
    session = ort.InferenceSession(g.to_model("test").SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {name: array for name, (array, _) in inputs.items()})


def test_onnx_int8_quantization_is_bit_identical_to_numpy():
    rows = _edge_values(np.random.default_rng(0))

    def build(g, names):
        codes, scales = quantize_int8(g, g.op("Reshape", names["rows"], g.const([0, 4, 8])))
        g.op("Identity", codes, out="codes"), g.op("Identity", scales, out="scales")
        return [("codes", TensorProto.INT8), ("scales", TensorProto.FLOAT)]

    codes, scales = _run(build, {"rows": (rows, TensorProto.FLOAT)})
    want_codes, want_scales = np_quantize_int8(rows, 4)
    np.testing.assert_array_equal(codes.reshape(rows.shape), want_codes)
    np.testing.assert_array_equal(scales, want_scales)
    assert list(codes[0, 0]) == [127, 0, 2, 2, 0, -2, 64, -64]  # half to even, as np.rint


def test_onnx_fp8_encoding_is_bit_identical_to_numpy():
    rng = np.random.default_rng(1)
    every_code = np_decode_fp8(np.arange(256, dtype=np.uint8))
    midpoints = (every_code[1:126] + every_code[2:127]) / 2  # exact ties between neighbouring codes
    values = np.concatenate([_edge_values(rng).ravel(), every_code[np.isfinite(every_code)], midpoints, -midpoints,
                             np.float32([1e-9, -1e-9, -0.0, 1e6, -1e6])]).astype(np.float32)  # fmt: skip
    scale = np.asarray(0.75, np.float32)

    def build(g, names):
        bits = encode_fp8(g, names["values"], names["scale"])
        g.op("Identity", bits, out="bits"), g.op("Identity", decode_fp8(g, bits, names["scale"]), out="back")
        return [("bits", TensorProto.UINT8), ("back", TensorProto.FLOAT)]

    bits, back = _run(build, {"values": (values * scale, TensorProto.FLOAT), "scale": (scale, TensorProto.FLOAT)})
    want = np_encode_fp8(values * scale, float(scale))
    np.testing.assert_array_equal(bits, want)
    np.testing.assert_array_equal(back, np_decode_fp8(want, float(scale)))
    assert bits[values.size - 3] == 0x80  # -0 keeps its sign bit


@pytest.fixture(scope="module")
def kv_engines(tmp_path_factory) -> dict[str, Path]:
    """int8 and fp8 tiny-llama (GQA 4:2), int8 tiny-mistral (sliding window 24)."""
    root = tmp_path_factory.mktemp("kv_graph")
    gate = root / "gate.json"
    gate.write_text(json.dumps({"version": 0, "thresholds": dict.fromkeys(("kv-int8", "kv-fp8"), LOOSE)}))
    engines = {}
    for model, kv in (("tiny-llama", "int8"), ("tiny-llama", "fp8"), ("tiny-mistral", "int8")):
        engines[f"{model}-{kv}"] = out = root / f"{model}-{kv}"
        build_engine(BuildOptions(
            model=model, output=out, max_batch_size=8, max_seq_len=TINY_MAX_SEQ_LEN, block_size=TINY_BLOCK_SIZE,
            kv_cache_dtype=kv, calibration=DataConfig(calibration_samples=8, heldout_samples=4, seq_len=64),
            gate_config=gate,
        ))  # fmt: skip
    return engines


def _steps(vocab: int) -> list[list[SequenceChunk]]:
    """Two sequences: prefill chunks (one ragged, one across blocks), then decodes of both together,
    the second sequence past the mistral window."""
    a, b = random_prompts(vocab, [13, 40], seed=5)
    ta, tb = [3, 9, 1, 6], [0, 7, 2, 11, 4, 10, 8]
    return [
        [SequenceChunk(a, 0, ta), SequenceChunk(b[:21], 0, tb)],
        [SequenceChunk(b[21:], 21, tb)],
        [SequenceChunk([5], 13, ta), SequenceChunk([6], 40, tb)],
        [SequenceChunk([7], 14, ta), SequenceChunk([8], 41, tb)],
    ]


@pytest.mark.parametrize("engine", ["tiny-llama-int8", "tiny-llama-fp8", "tiny-mistral-int8"])
def test_graph_and_plugin_match_the_cpu_backend_and_write_the_same_pool(kv_engines, engine):
    config = EngineConfig.load(kv_engines[engine])
    backends = {kind: create_backend(config, num_blocks=12, kind=kind) for kind in ("cpu", "graph", "plugin")}
    for step in _steps(config.model.vocab_size):
        logits = {kind: backend.step(step) for kind, backend in backends.items()}
        for kind in ("graph", "plugin"):
            np.testing.assert_allclose(logits[kind], logits["cpu"], atol=LOGITS_TOLERANCE, err_msg=kind)
    cpu = backends["cpu"].kv
    for kind in ("graph", "plugin"):
        kv = backends[kind].kv
        assert kv.data.dtype == cpu.data.dtype == np.dtype(config.kv_pool_dtype)
        # Both quantize the same rows identically (bit-exact above); a K/V value one ulp apart between
        # the two graphs' matmuls may round to the neighbouring code (int8, or E4M3 of the same sign).
        codes = np.abs(kv.data.view(np.int8 if kv.data.dtype == np.int8 else np.uint8).astype(np.int16)
                       - cpu.data.astype(np.int16))  # fmt: skip
        assert codes.max() <= 1 and np.mean(codes > 0) < 0.01, kind
        if cpu.scales is not None:
            np.testing.assert_allclose(kv.scales, cpu.scales, rtol=1e-5, err_msg=kind)


def test_the_plugin_graph_uses_the_quantized_ops(kv_engines):
    for engine, kind in (("tiny-llama-int8", "int8"), ("tiny-llama-fp8", "fp8")):
        model = onnx.load(kv_engines[engine] / PLUGIN_GRAPH_FILE, load_external_data=False)
        ops = [n.op_type for n in model.graph.node if n.domain == "trtserve"]
        write, attention = QUANTIZED_OPS[kind]
        assert ops.count(write) == ops.count(attention) == 2 and "PagedKVWrite" not in ops
        assert {f.name for f in model.functions} >= {write, attention}


def test_a_corrupted_scale_changes_what_the_graph_reads(kv_engines):
    """The graph dequantizes with the scale pool it is given, in place: scaling one block's scales
    changes the logits of the sequence that reads it, and only that one."""
    config = EngineConfig.load(kv_engines["tiny-llama-int8"])
    backend = create_backend(config, num_blocks=12, kind="graph")
    first, *_ = _steps(config.model.vocab_size)
    backend.step(first)
    decode = [SequenceChunk([5], 13, [3, 9, 1, 6]), SequenceChunk([6], 21, [0, 7, 2, 11, 4, 10, 8])]
    before = backend.step(decode)
    for side in (0, 1):
        backend.kv.scales[:, side, 9] *= 4.0  # block 9: sequence a's second block
    after = backend.step(decode)
    assert np.abs(after[0] - before[0]).max() > 1e-3
    np.testing.assert_allclose(after[1], before[1], atol=1e-5)


def test_build_refuses_a_quantized_cache_for_tensorrt_naming_why(tmp_path):
    with pytest.raises(BuildError, match="no TensorRT plugin takes a quantized pool"):
        BuildOptions(model="tiny-llama", output=tmp_path / "x", target="tensorrt", kv_cache_dtype="int8").validate()


def test_the_tensorrt_backend_refuses_a_quantized_cache_naming_why(kv_engines):
    """Checked before TensorRT is imported (this machine has none)."""
    from engine_format import EngineLoadError
    from executors.tensorrt import TrtBackend

    with pytest.raises(EngineLoadError, match="registers only the float-pool PagedKVWrite"):
        TrtBackend(EngineConfig.load(kv_engines["tiny-llama-fp8"]))

"""bfloat16 engines (`build-engine --dtype bfloat16`): bf16 weights and activations in both graphs, verified
through a float32 view of those graphs (ONNX Runtime has no bf16 MatMul on CPUs) and on the cpu-bf16
backend, which serves them on CPUs."""

from __future__ import annotations

import dataclasses
import json
import shutil

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from builder.build import BuildOptions, build_engine
from builder.errors import BuildError
from builder.verify import float32_view, verify_engine
from engine_format import EngineConfig, EngineLoadError
from engine_format.files import GRAPH_FILE, PLUGIN_GRAPH_FILE, WEIGHTS_FILE
from executors import create_backend, cuda_present, default_backend
from executors.torch.weights import load_weights
from runtime import LLM, SamplingParams
from tests.conftest import TINY_BLOCK_SIZE, TINY_MAX_SEQ_LEN
from tests.helpers import NEEDS_BF16_MATMUL

pytestmark = NEEDS_BF16_MATMUL  # a bfloat16 engine is verified and served on cpu-bf16

OPTIONS = dict(model="tiny-llama", max_batch_size=4, max_seq_len=TINY_MAX_SEQ_LEN, block_size=TINY_BLOCK_SIZE)


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "engine"
    build_engine(BuildOptions(output=out, dtype="bfloat16", **OPTIONS))
    return out


@pytest.fixture(scope="module")
def hf_model():
    from builder.sources import load_checkpoint, resolve_model

    return load_checkpoint(resolve_model("tiny-llama"))[0]


def bf16_types(model: onnx.ModelProto) -> list[str]:
    """Every place a graph names bfloat16: initializers, graph I/O, Cast targets, Constants."""
    graph = model.graph
    found = [t.name for t in graph.initializer if t.data_type == TensorProto.BFLOAT16]
    found += [v.name for v in (*graph.input, *graph.output) if v.type.tensor_type.elem_type == TensorProto.BFLOAT16]
    for node in [*graph.node, *(n for f in model.functions for n in f.node)]:
        for a in node.attribute:
            if (a.name == "to" and a.i == TensorProto.BFLOAT16) or a.t.data_type == TensorProto.BFLOAT16:
                found.append(f"{node.op_type}:{node.name}")
    return found


def test_the_build_stores_bf16_weights_and_passes_its_verification(bf16_engine, llama_engine):
    manifest = json.loads((bf16_engine / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["kv_layout"]["pool_dtype"] == "bfloat16"
    spec = EngineConfig.load(bf16_engine).model
    assert manifest["kv_layout"]["bytes_per_token"] == spec.num_layers * 2 * spec.kv_width * 2
    verification = manifest["verification"]
    assert set(verification["backends"]) == {"graph", "plugin", "cpu-bf16"}
    for record in verification["backends"].values():
        assert max(record["max_abs_error"].values()) <= verification["tolerance"]
    # the bound is HF's own bfloat16 error (x2) or 3% of the largest logit, not looser
    assert verification["tolerance"] == pytest.approx(
        max(0.03 * verification["max_abs_logit"], 2 * verification["hf_bfloat16_max_abs_error"])
    )
    graph = onnx.load(str(bf16_engine / GRAPH_FILE), load_external_data=False).graph
    floats = [t for t in graph.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.BFLOAT16)]
    assert floats and all(t.data_type == TensorProto.BFLOAT16 for t in floats)
    ratio = (bf16_engine / WEIGHTS_FILE).stat().st_size / (llama_engine / WEIGHTS_FILE).stat().st_size
    assert 0.45 < ratio < 0.55  # half of the float32 engine's bytes
    assert not (bf16_engine / "segment.00.onnx").exists()  # the ORT CPU segments are float32-only


def test_weights_load_as_the_checkpoints_bf16_rounding(bf16_engine, hf_model):
    weights = load_weights(EngineConfig.load(bf16_engine), torch.device("cpu"), torch.bfloat16)
    state = hf_model.state_dict()
    assert torch.equal(weights.embed, state["model.embed_tokens.weight"].to(torch.bfloat16))
    qkv = torch.cat([state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]).T
    assert torch.equal(weights.layers[0].qkv.weight, qkv.to(torch.bfloat16))
    assert weights.cos.dtype == torch.float32  # tables widen exactly from their bf16 storage


def test_the_float32_view_widens_every_bf16_type_exactly(bf16_engine, tmp_path):
    config = EngineConfig.load(bf16_engine)
    view = float32_view(config, tmp_path)
    assert view.dtype == "float32" and view.engine_dir == tmp_path
    for graph_file in (GRAPH_FILE, PLUGIN_GRAPH_FILE):
        original = onnx.load(str(bf16_engine / graph_file))
        widened = onnx.load(str(tmp_path / graph_file))
        assert bf16_types(original) and not bf16_types(widened)
        before = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
        for tensor in widened.graph.initializer:
            if before[tensor.name].dtype == ml_dtypes.bfloat16:
                np.testing.assert_array_equal(numpy_helper.to_array(tensor), before[tensor.name].astype(np.float32))


def test_verification_catches_a_corrupted_weight(bf16_engine, hf_model, tmp_path):
    """The check can fail: layer 0's o_proj negated in place in model.onnx.data (bf16: the sign bit)."""
    engine = tmp_path / "engine"
    shutil.copytree(bf16_engine, engine)
    graph = onnx.load(str(engine / GRAPH_FILE), load_external_data=False).graph
    tensor = next(t for t in graph.initializer if t.name == "layer0.o_proj")
    where = {entry.key: int(entry.value) for entry in tensor.external_data if entry.key in ("offset", "length")}
    data = np.memmap(engine / WEIGHTS_FILE, np.uint16, "r+", offset=where["offset"], shape=(where["length"] // 2,))
    data ^= 0x8000
    data.flush()
    config = dataclasses.replace(EngineConfig.load(bf16_engine), engine_dir=engine)
    with pytest.raises(BuildError, match="verification failed"):
        verify_engine(config, hf_model)


def test_cpus_serve_it_on_the_cpu_bf16_backend(bf16_engine):
    config = EngineConfig.load(bf16_engine)
    assert default_backend(config) == ("torch" if cuda_present() else "cpu-bf16")
    for kind, hint in (("graph", "--backend cpu-bf16"), ("cpu", "--backend cpu-bf16")):
        with pytest.raises(EngineLoadError, match=hint):
            create_backend(config, num_blocks=8, kind=kind)
    backend = create_backend(config, num_blocks=8, kind="cpu-bf16")
    assert backend.pool.dtype == np.float32  # attention reads a float32 pool on this backend
    llm = LLM(bf16_engine, max_num_batched_tokens=16)
    outs = llm.generate([[5, 6, 7, 8] * 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(outs[0].token_ids) == 5 and llm.engine.kv.pool.usage == 0


@pytest.mark.parametrize("extra", [{"quantize": "int4-rtn"}, {"kv_cache_dtype": "int8"}])
def test_quantized_bf16_builds_are_refused_before_any_work(tmp_path, extra):
    with pytest.raises(BuildError, match="--dtype bfloat16 builds unquantized engines"):
        build_engine(BuildOptions(output=tmp_path / "engine", dtype="bfloat16", **OPTIONS, **extra))
    assert not (tmp_path / "engine").exists()

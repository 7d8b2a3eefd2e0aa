"""The portable graph -> TensorRT plugin graph rewrite (parity with the portable graph runs
for every tiny architecture in test_engine_parity, kind "plugin")."""

from __future__ import annotations

import collections
import shutil

import numpy as np
import onnx

from builder.plugin_graph import (
    ATTENTION,
    DOMAIN,
    KV_WRITE,
    MERGE,
    PROLOGUE,
    rewrite_to_plugins,
    strip_reference_functions,
)
from engine_format import EngineConfig
from engine_format.files import PLUGIN_GRAPH_FILE
from executors import create_backend
from executors.base import SequenceChunk


def test_every_layer_is_rewritten(tiny_engine):
    config = EngineConfig.load(tiny_engine)
    model = onnx.load(tiny_engine / PLUGIN_GRAPH_FILE, load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    layers = config.model.num_layers
    assert ops[PROLOGUE] == ops[KV_WRITE] == ops[ATTENTION] == layers
    assert ops["Attention"] == ops["RotaryEmbedding"] == 0
    assert ops["LessOrEqual"] == 0 and not any("attn_mask" in n.name for n in model.graph.node)  # dead mask removed
    assert ops["RMSNormalization"] == layers + 1  # the post-attention norms and the final norm stay


def test_plugin_nodes_carry_their_shapes(tiny_engine):
    spec = EngineConfig.load(tiny_engine).model
    model = onnx.load(tiny_engine / PLUGIN_GRAPH_FILE, load_external_data=False)
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == PROLOGUE:
            assert node.domain == DOMAIN and attrs["num_heads"] == spec.num_heads
            assert list(attrs["split_sizes"]) == [spec.num_heads * spec.head_dim, spec.kv_width, spec.kv_width]
        if node.op_type == ATTENTION:
            assert attrs["num_kv_heads"] == spec.num_kv_heads and list(node.input)[-1] == "positions"
            layer = int(node.name.removeprefix("layer").split(".")[0])
            assert attrs["window"] == (spec.sliding_windows[layer] or 0)
        if node.op_type == KV_WRITE:
            assert attrs["block_size"] == EngineConfig.load(tiny_engine).block_size
            assert list(node.output) == [f"{node.input[2]}.written", f"{node.input[3]}.written"]
    assert {f.name for f in model.functions} == {PROLOGUE, KV_WRITE, ATTENTION, MERGE}
    stripped = strip_reference_functions(model)
    assert not stripped.functions and len(stripped.graph.node) == len(model.graph.node)


def test_a_wrong_plugin_attribute_is_caught(tiny_engine, tmp_path):
    """The parity check can fail: a plugin node with a doubled attention scale differs."""
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    model = onnx.load(engine / "model.onnx", load_external_data=False)
    broken = rewrite_to_plugins(model)
    for node in broken.graph.node:
        if node.op_type == ATTENTION:
            for attr in node.attribute:
                if attr.name == "scale":
                    attr.f *= 2
    onnx.save_model(broken, engine / PLUGIN_GRAPH_FILE)
    config = EngineConfig.load(engine)
    chunk = [SequenceChunk(list(range(3, 30)), 0, [0, 1, 2, 3])]
    good = create_backend(config, num_blocks=8, kind="graph").step(chunk)
    bad = create_backend(config, num_blocks=8, kind="plugin").step(chunk)
    assert np.abs(good - bad).max() > 1e-3

"""Rewrite the portable graph into the plugin graph that TensorRT builds.

Two patterns per decoder layer become ops of our own (domain `trtserve`, names that are not
ONNX ops), implemented on the GPU by the kernels in plugins_cuda/:
- RMSNormalization -> MatMul(QKV) [-> Add(bias)] -> Split -> RotaryEmbedding(Q), (K)
  becomes `FusedRMSNormQKVRoPE(x, norm_weight, w_qkv, bias, cos, sin, positions) -> q, k, v`;
- Gather(pool, block_tables) -> Reshape -> Concat(new rows) for K and for V -> Attention
  becomes `PagedAttention(q, k, v, key_cache, value_cache, block_tables, mask) -> ctx`.

Each op also gets a model-local ONNX function holding exactly the subgraph it replaced, so
ONNX Runtime on the CPU runs the plugin graph and tests compare it with the portable one.
`strip_reference_functions` removes those bodies before a TensorRT build (the parser would
otherwise inline them instead of mapping the nodes to plugins).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from builder.errors import BuildError
from builder.onnx_graph import OPSET

DOMAIN = "trtserve"
PLUGIN_FILE = "model.plugins.onnx"
PROLOGUE, ATTENTION = "FusedRMSNormQKVRoPE", "PagedAttention"


def _ref(name: str, kind: int) -> onnx.AttributeProto:
    attr = onnx.AttributeProto()
    attr.name, attr.ref_attr_name, attr.type = name, name, kind
    return attr


def _node(op: str, inputs: list[str], outputs: list[str], refs: dict[str, tuple[str, int]] = (), **attrs):
    """A function-body node; `refs` maps node attribute -> (function attribute, type)."""
    node = helper.make_node(op, inputs, outputs, **attrs)
    for attr, (ref, kind) in dict(refs).items():
        a = _ref(ref, kind)
        a.name = attr
        node.attribute.append(a)
    return node


def reference_functions() -> list[onnx.FunctionProto]:
    ints, i, f = onnx.AttributeProto.INTS, onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT
    prologue = helper.make_function(
        DOMAIN, PROLOGUE,
        inputs=["x", "norm_weight", "w_qkv", "bias", "cos", "sin", "positions"], outputs=["q", "k", "v"],
        nodes=[
            _node("RMSNormalization", ["x", "norm_weight"], ["xn"], {"epsilon": ("epsilon", f)}, axis=-1),
            _node("MatMul", ["xn", "w_qkv"], ["proj"]),
            _node("Add", ["proj", "bias"], ["qkv"]),
            _node("Constant", [], ["sizes"], {"value_ints": ("split_sizes", ints)}),
            _node("Split", ["qkv", "sizes"], ["q_pre", "k_pre", "v"], axis=-1),
            _node("RotaryEmbedding", ["q_pre", "cos", "sin", "positions"], ["q"], {"num_heads": ("num_heads", i)}),
            _node("RotaryEmbedding", ["k_pre", "cos", "sin", "positions"], ["k"], {"num_heads": ("num_kv_heads", i)}),
        ],
        opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=["epsilon", "split_sizes", "num_heads", "num_kv_heads"],
    )  # fmt: skip
    attention_nodes = [_node("Constant", [], ["cached_shape"], {"value_ints": ("cached_shape", ints)})]
    for kind in ("key", "value"):
        attention_nodes += [
            _node("Gather", [f"{kind}_cache", "block_tables"], [f"{kind}_blocks"], axis=0),
            _node("Reshape", [f"{kind}_blocks", "cached_shape"], [f"{kind}_cached"]),
            _node("Concat", [f"{kind}_cached", kind[0]], [f"{kind}_all"], axis=1),
        ]
    attention_nodes.append(_node(
        "Attention", ["q", "key_all", "value_all", "mask"], ["ctx"],
        {"q_num_heads": ("num_heads", i), "kv_num_heads": ("num_kv_heads", i), "scale": ("scale", f)},
    ))  # fmt: skip
    attention = helper.make_function(
        DOMAIN, ATTENTION,
        inputs=["q", "k", "v", "key_cache", "value_cache", "block_tables", "mask"], outputs=["ctx"],
        nodes=attention_nodes, opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=["cached_shape", "num_heads", "num_kv_heads", "scale"],
    )  # fmt: skip
    return [prologue, attention]


class _Graph:
    """Producer/consumer index over a graph's nodes."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer = {out: n for n in graph.node for out in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in graph.node:
            for name in n.input:
                self.consumers[name].append(n)
        self.constants = {t.name: t for t in graph.initializer}

    def only_consumer(self, name: str, op: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def ints(self, name: str) -> list[int]:
        return numpy_helper.to_array(self.constants[name]).astype(np.int64).tolist()


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def rewrite_to_plugins(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with both patterns replaced in every layer (weights untouched)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = _Graph(model.graph)
    removed: set[int] = set()
    replacements: dict[int, onnx.NodeProto] = {}  # index of the first removed node -> new node
    index = {id(n): k for k, n in enumerate(model.graph.node)}

    def replace(old: list[onnx.NodeProto], new: onnx.NodeProto) -> None:
        positions = [index[id(n)] for n in old]
        removed.update(positions)
        replacements[max(positions)] = new  # where its last input is surely computed

    for norm in [n for n in model.graph.node if n.op_type == "RMSNormalization"]:
        matmul = g.only_consumer(norm.output[0], "MatMul")
        if matmul is None:
            continue  # the final norm feeds Gemm (lm_head): not a prologue
        add = g.only_consumer(matmul.output[0], "Add")
        split = g.only_consumer((add or matmul).output[0], "Split")
        rope_q = split and g.only_consumer(split.output[0], "RotaryEmbedding")
        rope_k = split and g.only_consumer(split.output[1], "RotaryEmbedding")
        if not (split and rope_q and rope_k):
            continue  # e.g. the post-attention norm, which feeds the MLP
        sizes = g.ints(split.input[1])
        if add is not None:
            bias = add.input[1]
        else:
            bias = f"{matmul.name}.zero_bias"
            model.graph.initializer.append(numpy_helper.from_array(np.zeros(sum(sizes), np.float32), bias))
        fused = helper.make_node(
            PROLOGUE, [norm.input[0], norm.input[1], matmul.input[1], bias, *rope_q.input[1:4]],
            [rope_q.output[0], rope_k.output[0], split.output[2]], name=norm.name.replace("input_norm", "prologue"),
            domain=DOMAIN, epsilon=_attr(norm, "epsilon", 1e-5), split_sizes=sizes,
            num_heads=_attr(rope_q, "num_heads"), num_kv_heads=_attr(rope_k, "num_heads"),
        )  # fmt: skip
        replace([n for n in (norm, matmul, add, split, rope_q, rope_k) if n is not None], fused)

    for attention in [n for n in model.graph.node if n.op_type == "Attention"]:
        parts = []
        for side in (1, 2):  # K, V
            concat = g.made_by(attention.input[side], "Concat")
            reshape = concat and g.made_by(concat.input[0], "Reshape")
            gather = reshape and g.made_by(reshape.input[0], "Gather")
            if not gather:
                raise BuildError(f"plugin rewrite: {attention.name} does not read the paged pool")
            parts.append((concat, reshape, gather))
        (ck, rk, gk), (cv, _, gv) = parts
        paged = helper.make_node(
            ATTENTION, [attention.input[0], ck.input[1], cv.input[1], gk.input[0], gv.input[0], gk.input[1],
                        attention.input[3]],
            [attention.output[0]], name=attention.name.replace("attention", "paged_attention"), domain=DOMAIN,
            cached_shape=g.ints(rk.input[1]), num_heads=_attr(attention, "q_num_heads"),
            num_kv_heads=_attr(attention, "kv_num_heads"), scale=_attr(attention, "scale"),
        )  # fmt: skip
        replace([attention, *parts[0], *parts[1]], paged)

    counts = defaultdict(int)
    for node in replacements.values():
        counts[node.op_type] += 1
    layers = sum(1 for n in model.graph.node if n.op_type == "Attention")
    if counts[PROLOGUE] != layers or counts[ATTENTION] != layers:
        raise BuildError(f"plugin rewrite matched {dict(counts)} in a graph of {layers} attention layers")
    nodes = []
    for k, node in enumerate(model.graph.node):
        if k not in removed:
            nodes.append(node)
        if k in replacements:
            nodes.append(replacements[k])
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.functions.extend(reference_functions())
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def strip_reference_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """For the TensorRT parser: plugin nodes must not have bodies it could inline."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    del model.functions[:]
    return model


def write_plugin_graph(engine_dir: Path) -> Path:
    """engine_dir/model.onnx -> engine_dir/model.plugins.onnx (same weights file)."""
    portable = onnx.load(engine_dir / "model.onnx", load_external_data=False)
    rewritten = rewrite_to_plugins(portable)
    path = engine_dir / PLUGIN_FILE
    onnx.save_model(rewritten, path)
    onnx.checker.check_model(str(path))
    return path

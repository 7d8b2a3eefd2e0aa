"""Rewrite the portable graph into the plugin graph that TensorRT builds.

Per decoder layer, two patterns become three ops of our own (domain `trtserve`, names that
are not ONNX ops), each implemented on the GPU by one Triton kernel in plugins_cuda/:
- RMSNormalization -> MatMul(QKV) [-> Add(bias)] -> Split -> RotaryEmbedding(Q), (K)
  becomes `FusedRMSNormQKVRoPE(x, norm_weight, w_qkv, bias, cos, sin, positions) -> q, k, v`;
- Gather(pool, block_tables) -> Reshape -> Concat(new rows) for K and V -> Attention(mask)
  becomes `PagedKVWrite(k, v, key_cache, value_cache, block_tables, positions, seq_lens)
  -> key_cache', value_cache'` (in place on a GPU) followed by
  `PagedAttention(q, key_cache', value_cache', block_tables, positions) -> ctx, partials`, which
  masks by position itself, and `PagedAttentionMerge(ctx, partials, block_tables, positions)
  -> ctx` (split-KV decode's second kernel); the mask subgraph is then dead and removed.

With a quantized KV cache (int8/fp8) the KV write and attention are `PagedKVWriteInt8` /
`PagedAttentionInt8` (scale pools in and out) or `...FP8` (the per-layer `kv_scales`), fed the
float rows that enter the portable graph's `layer{i}.{k,v}_quantize`; the portable graph's own
quantize nodes stay for `new_kv`, its dequantize nodes die.

The plugin graph's `block_tables` must cover this step's positions too (INTERFACE.md).
Semantics live in builder/plugin_functions.py as model-local function bodies, so ONNX Runtime
on the CPU runs the plugin graph; `strip_reference_functions` removes them for TensorRT.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from builder.errors import BuildError
from builder.kv_graph import KV_SCALES, cache_names, scale_names
from builder.kv_onnx import POOL_ELEM_TYPES
from builder.plugin_functions import (
    ATTENTION,
    DOMAIN,
    KV_WRITE,
    MERGE,
    PROLOGUE,
    merge_function,
    prologue_function,
    reference_functions,
)  # fmt: skip
from builder.plugin_functions_kv import QUANTIZED_OPS, quantized_functions
from engine_format.files import GRAPH_FILE, PLUGIN_GRAPH_FILE

__all__ = ["ATTENTION", "DOMAIN", "KV_WRITE", "MERGE", "PROLOGUE", "rewrite_to_plugins"]


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
        self.by_name = {n.name: n for n in graph.node}

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


def _window(g: _Graph, attention: onnx.NodeProto) -> int:
    """The layer's sliding window, from the exporter's mask node name (`attn_mask_w{window}`)."""
    mask = g.producer.get(attention.input[3])
    match = re.fullmatch(r"attn_mask_w(\d+)", mask.name if mask is not None else "")
    if not match:
        raise BuildError(f"plugin rewrite: cannot tell the attention window of {attention.name}")
    return int(match.group(1))


def _prologue(g: _Graph, model: onnx.ModelProto, norm: onnx.NodeProto):
    """The fused node replacing norm -> QKV -> RoPE, and the nodes it replaces; None if no match."""
    matmul = g.only_consumer(norm.output[0], "MatMul")
    if matmul is None:
        return None  # the final norm feeds Gemm (lm_head): not a prologue
    if matmul.input[1] not in g.constants:
        # Quantized weights (DequantizeLinear -> MatMul) keep their Q/DQ form: the fused kernel
        # takes float weights, while TensorRT runs Q/DQ GEMMs in INT4/FP8 natively.
        return None
    add = g.only_consumer(matmul.output[0], "Add")
    split = g.only_consumer((add or matmul).output[0], "Split")
    rope_q = split and g.only_consumer(split.output[0], "RotaryEmbedding")
    rope_k = split and g.only_consumer(split.output[1], "RotaryEmbedding")
    if not (split and rope_q and rope_k):
        return None  # e.g. the post-attention norm, which feeds the MLP
    sizes = g.ints(split.input[1])
    if add is not None:
        bias = add.input[1]
    else:
        bias = f"{matmul.name}.zero_bias"
        weight_type = onnx.helper.tensor_dtype_to_np_dtype(g.constants[matmul.input[1]].data_type)  # the engine's
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(sum(sizes), weight_type), bias))
    fused = helper.make_node(
        PROLOGUE, [norm.input[0], norm.input[1], matmul.input[1], bias, *rope_q.input[1:4]],
        [rope_q.output[0], rope_k.output[0], split.output[2]], name=norm.name.replace("input_norm", "prologue"),
        domain=DOMAIN, epsilon=_attr(norm, "epsilon", 1e-5), split_sizes=sizes,
        num_heads=_attr(rope_q, "num_heads"), num_kv_heads=_attr(rope_k, "num_heads"),
    )  # fmt: skip
    return [fused], [n for n in (norm, matmul, add, split, rope_q, rope_k) if n is not None]


def _paged(g: _Graph, attention: onnx.NodeProto, block_size: int):
    """KV write + paged attention replacing Gather/Reshape/Concat x2 -> Attention."""
    parts = []
    for side in (1, 2):  # K, V
        concat = g.made_by(attention.input[side], "Concat")
        reshape = concat and g.made_by(concat.input[0], "Reshape")
        gather = reshape and g.made_by(reshape.input[0], "Gather")
        if not gather:
            raise BuildError(f"plugin rewrite: {attention.name} does not read the paged pool")
        parts.append((concat, reshape, gather))
    (ck, rk, gk), (cv, _, gv) = parts
    key_cache, value_cache, block_tables = gk.input[0], gv.input[0], gk.input[1]
    written = [f"{key_cache}.written", f"{value_cache}.written"]
    write = helper.make_node(
        KV_WRITE, [ck.input[1], cv.input[1], key_cache, value_cache, block_tables, "positions", "seq_lens"], written,
        name=attention.name.replace("attention", "kv_write"), domain=DOMAIN, block_size=block_size,
    )  # fmt: skip
    return [write, *_attention(g, attention, ATTENTION, written, g.ints(rk.input[1]), block_size)], \
        [attention, *parts[0], *parts[1]]  # fmt: skip


def _paged_quantized(g: _Graph, attention: onnx.NodeProto, block_size: int, kind: str):
    """The quantized pool's KV write + paged attention; the rest of the old subgraph dies."""
    match = re.fullmatch(r"layer(\d+)\.attention", attention.name)
    anchors = [match and g.by_name.get(f"layer{match.group(1)}.{side}_quantize") for side in "kv"]
    cached = match and g.by_name.get(f"layer{match.group(1)}.k_cached")
    if not (match and anchors[0] and anchors[1] and cached):
        raise BuildError(f"plugin rewrite: {attention.name} does not read a quantized paged pool")
    layer = int(match.group(1))
    caches, kv_heads = list(cache_names(layer)), _attr(attention, "kv_num_heads")
    cached_shape = g.ints(cached.input[1])
    extra: dict
    if kind == "int8":  # the scale pools go in, the attention reads the written ones
        scales_in, scales_out = list(scale_names(layer)), [f"{s}.written" for s in scale_names(layer)]
        attention_scales, extra = scales_out, {"kv_head_shape": [kv_heads, cached_shape[-1] // kv_heads]}
    else:  # both read the per-layer scales
        scales_in, scales_out, attention_scales, extra = [KV_SCALES], [], [KV_SCALES], {"layer": layer}
    written = [f"{c}.written" for c in caches]
    write_op, attention_op = QUANTIZED_OPS[kind]
    write = helper.make_node(
        write_op, [anchors[0].input[0], anchors[1].input[0], *caches, "block_tables", "positions", "seq_lens",
                   *scales_in], written + scales_out,
        name=attention.name.replace("attention", "kv_write"), domain=DOMAIN, block_size=block_size, **extra,
    )  # fmt: skip
    nodes = _attention(g, attention, attention_op, written, cached_shape, block_size, attention_scales, **extra)
    return [write, *nodes], [attention]


def _attention(g: _Graph, attention: onnx.NodeProto, op: str, pools: list[str], cached_shape: list[int],
               block_size: int, extra_inputs: tuple | list = (), **extra) -> list[onnx.NodeProto]:  # fmt: skip
    """Paged attention over the written pools + the split-KV merge, replacing `attention`."""
    ctx, heads, kv_heads = attention.output[0], _attr(attention, "q_num_heads"), _attr(attention, "kv_num_heads")
    paged = helper.make_node(
        op, [attention.input[0], *pools, "block_tables", "positions", *extra_inputs],
        [f"{ctx}.unmerged", f"{ctx}.partials"], name=attention.name.replace("attention", "paged_attention"),
        domain=DOMAIN, num_heads=heads, num_kv_heads=kv_heads,
        scale=_attr(attention, "scale"), window=_window(g, attention), cached_shape=cached_shape, **extra,
    )  # fmt: skip
    merge = helper.make_node(
        MERGE, [*paged.output, "block_tables", "positions"], [ctx], name=attention.name.replace("attention", "merge"),
        domain=DOMAIN, num_heads=heads, num_kv_heads=kv_heads, head_dim=cached_shape[-1] // kv_heads,
        block_size=block_size,
    )  # fmt: skip
    return [paged, merge]


def _kv_kind(model: onnx.ModelProto) -> str:
    """The pool's KV dtype, from key_cache.0's element type ("auto": a float pool)."""
    kinds = {elem: kind for kind, elem in POOL_ELEM_TYPES.items()}
    for value in model.graph.input:
        if value.name == "key_cache.0":
            return kinds.get(value.type.tensor_type.elem_type, "auto")
    return "auto"


def _block_size(model: onnx.ModelProto) -> int:
    for value in model.graph.input:
        if value.name == "key_cache.0":
            return value.type.tensor_type.shape.dim[1].dim_value
    raise BuildError("plugin rewrite: the graph has no key_cache.0 input")


def rewrite_to_plugins(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with both patterns replaced in every layer (weights untouched)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = _Graph(model.graph)
    block_size = _block_size(model)
    removed: set[int] = set()
    replacements: dict[int, list[onnx.NodeProto]] = {}  # index of the last removed node -> new nodes
    index = {id(n): k for k, n in enumerate(model.graph.node)}
    matches = [_prologue(g, model, n) for n in model.graph.node if n.op_type == "RMSNormalization"]
    kind = _kv_kind(model)
    attentions = [n for n in model.graph.node if n.op_type == "Attention"]
    if kind == "auto":
        matches += [_paged(g, n, block_size) for n in attentions]
    else:
        matches += [_paged_quantized(g, n, block_size, kind) for n in attentions]
    for new, old in filter(None, matches):
        positions = [index[id(n)] for n in old]
        removed.update(positions)
        replacements[max(positions)] = new  # where its last input is surely computed

    counts = defaultdict(int)
    for nodes in replacements.values():
        for node in nodes:
            counts[node.op_type] += 1
    layers = sum(1 for n in model.graph.node if n.op_type == "Attention")
    float_qkv = sum(1 for n in model.graph.node if n.name.endswith("qkv_proj") and n.input[1] in g.constants)
    write_op, attention_op = QUANTIZED_OPS.get(kind, (KV_WRITE, ATTENTION))
    expected = {PROLOGUE: float_qkv, write_op: layers, attention_op: layers, MERGE: layers}
    if not layers or any(counts[op] != n for op, n in expected.items()):
        raise BuildError(f"plugin rewrite matched {dict(counts)} in a graph of {layers} attention layers")
    nodes = []
    for k, node in enumerate(model.graph.node):
        if k not in removed:
            nodes.append(node)
        nodes.extend(replacements.get(k, []))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _remove_dead_nodes(model.graph)
    if kind == "auto":
        model.functions.extend(reference_functions())
    else:
        model.functions.extend([prologue_function(), *quantized_functions(kind), merge_function()])
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def _remove_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drop nodes and initializers no graph output depends on (the portable mask subgraph)."""
    live = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(out in live for out in node.output):
            kept.append(node)
            live.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = [t for t in graph.initializer if t.name in live]
    del graph.initializer[:]
    graph.initializer.extend(used)


def strip_reference_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """For the TensorRT parser: plugin nodes must not have bodies it could inline."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    del model.functions[:]
    return model


def write_plugin_graph(engine_dir: Path) -> Path:
    """engine_dir/model.onnx -> engine_dir/model.plugins.onnx (same weights file)."""
    portable = onnx.load(engine_dir / GRAPH_FILE, load_external_data=False)
    rewritten = rewrite_to_plugins(portable)
    path = engine_dir / PLUGIN_GRAPH_FILE
    onnx.save_model(rewritten, path)
    onnx.checker.check_model(str(path))
    return path

"""Model-local ONNX function bodies of the plugin ops (domain `trtserve`).

Each body states the op's exact semantics with standard ONNX ops, so ONNX Runtime on the CPU
runs the plugin graph and tests compare it with the portable graph. The TensorRT build strips
them (`strip_reference_functions`) and maps each node to the plugin of the same name.

- `FusedRMSNormQKVRoPE(x, norm_weight, w_qkv, bias, cos, sin, positions) -> q, k, v`
- `PagedKVWrite(k, v, key_cache, value_cache, block_tables, positions, seq_lens)
   -> key_cache', value_cache'`: row `[b, i]` (i < seq_lens[b]) goes to pool slot
   `block_tables[b, p // block_size] * block_size + p % block_size`, p = positions[b, i]. On a
   GPU the outputs alias the inputs (written in place); this body returns updated copies.
- `PagedAttention(q, key_cache, value_cache, block_tables, positions) -> ctx, partials`: query
   `[b, i]` attends to the pool rows at positions `j <= p` (and `j > p - window` when window > 0)
   of its sequence's block table; this step's rows are already in the pool. `partials` is the
   GPU kernel's split-KV workspace (here a placeholder); padding rows of `ctx` are unspecified.
- `PagedAttentionMerge(ctx, partials, block_tables, positions) -> ctx'`: completes the rows the
   GPU split across programs, in place; here the identity.
"""

from __future__ import annotations

import onnx
from onnx import helper

from builder.onnx_graph import OPSET

DOMAIN = "trtserve"
PROLOGUE, KV_WRITE, ATTENTION = "FusedRMSNormQKVRoPE", "PagedKVWrite", "PagedAttention"
MERGE = "PagedAttentionMerge"
INTS, INT, FLOAT = onnx.AttributeProto.INTS, onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT


def _node(op: str, inputs: list[str], outputs: list[str], refs: dict[str, tuple[str, int]] | None = None, **attrs):
    """A function-body node; `refs` maps node attribute -> (function attribute, type)."""
    node = helper.make_node(op, inputs, outputs, **attrs)
    for attr, (ref, kind) in (refs or {}).items():
        a = onnx.AttributeProto()
        a.name, a.ref_attr_name, a.type = attr, ref, kind
        node.attribute.append(a)
    return node


def _function(name: str, inputs: list[str], outputs: list[str], nodes: list, attributes: list[str]):
    return helper.make_function(
        DOMAIN, name, inputs=inputs, outputs=outputs, nodes=nodes,
        opset_imports=[helper.make_opsetid("", OPSET)], attributes=attributes,
    )  # fmt: skip


def _const(name: str, value) -> onnx.NodeProto:
    return _node("Constant", [], [name], value_ints=value) if isinstance(value, list) else \
        _node("Constant", [], [name], value_int=value)  # fmt: skip


def prologue_function() -> onnx.FunctionProto:
    return _function(PROLOGUE, ["x", "norm_weight", "w_qkv", "bias", "cos", "sin", "positions"], ["q", "k", "v"], [
        _node("RMSNormalization", ["x", "norm_weight"], ["xn"], {"epsilon": ("epsilon", FLOAT)}, axis=-1),
        _node("MatMul", ["xn", "w_qkv"], ["proj"]),
        _node("Add", ["proj", "bias"], ["qkv"]),
        _node("Constant", [], ["sizes"], {"value_ints": ("split_sizes", INTS)}),
        _node("Split", ["qkv", "sizes"], ["q_pre", "k_pre", "v"], axis=-1),
        _node("RotaryEmbedding", ["q_pre", "cos", "sin", "positions"], ["q"], {"num_heads": ("num_heads", INT)}),
        _node("RotaryEmbedding", ["k_pre", "cos", "sin", "positions"], ["k"], {"num_heads": ("num_kv_heads", INT)}),
    ], ["epsilon", "split_sizes", "num_heads", "num_kv_heads"])  # fmt: skip


def slot_nodes() -> list[onnx.NodeProto]:
    """Each row's pool slot as `indices` [B, S, 1] into a flat pool of `num_slots` rows plus a spare.

    Padding rows (i >= seq_lens[b]) are sent to one extra row appended to the flat pool and
    dropped afterwards: ScatterND would otherwise need their (duplicate) slots to be harmless."""
    return [
        _node("Constant", [], ["bs"], {"value_int": ("block_size", INT)}),
        _const("zero", 0), _const("one", 1), _const("first", [0]), _const("second", [1]), _const("last", [-1]),
        _const("width_axis", [2]), _const("width_axis_end", [3]),
        _node("Div", ["positions", "bs"], ["block_index"]),
        _node("Mod", ["positions", "bs"], ["offset"]),
        _node("GatherElements", ["block_tables", "block_index"], ["blocks"], axis=1),
        _node("Mul", ["blocks", "bs"], ["block_base"]),
        _node("Add", ["block_base", "offset"], ["slots"]),
        _node("Shape", ["positions"], ["step"], start=1, end=2),
        _node("Squeeze", ["step"], ["step_scalar"]),
        _node("Range", ["zero", "step_scalar", "one"], ["row"]),
        _node("Unsqueeze", ["row", "first"], ["row_2d"]),
        _node("Unsqueeze", ["seq_lens", "second"], ["seq_lens_2d"]),
        _node("Less", ["row_2d", "seq_lens_2d"], ["real"]),
    ]  # fmt: skip


def scatter_nodes(pool: str, rows: str, out: str) -> list[onnx.NodeProto]:
    """`pool` [num_blocks, block_size, width] with `rows` [B, S, width] written at `indices`."""
    return [
        _node("Shape", [pool], [f"{pool}_shape"]),
        _node("Slice", [f"{pool}_shape", "width_axis", "width_axis_end"], [f"{pool}_width"]),
        _node("Concat", ["last", f"{pool}_width"], [f"{pool}_flat_shape"], axis=0),
        _node("Shape", [pool], [f"{pool}_block_dims"], start=0, end=2),
        _node("ReduceProd", [f"{pool}_block_dims"], [f"{pool}_slots"], keepdims=1),
        _node("Where", ["real", "slots", f"{pool}_slots"], [f"{pool}_target"]),  # padding rows -> the spare row
        _node("Unsqueeze", [f"{pool}_target", "last"], [f"{pool}_indices"]),
        _node("Reshape", [pool, f"{pool}_flat_shape"], [f"{pool}_flat"]),
        _node("Slice", [f"{pool}_flat", "first", "second"], [f"{pool}_spare"]),
        _node("Concat", [f"{pool}_flat", f"{pool}_spare"], [f"{pool}_padded"], axis=0),
        _node("ScatterND", [f"{pool}_padded", f"{pool}_indices", rows], [f"{pool}_scattered"]),
        _node("Slice", [f"{pool}_scattered", "first", f"{pool}_slots", "first"], [f"{pool}_trimmed"]),
        _node("Reshape", [f"{pool}_trimmed", f"{pool}_shape"], [out]),
    ]


KV_WRITE_INPUTS = ["k", "v", "key_cache", "value_cache", "block_tables", "positions", "seq_lens"]


def kv_write_function() -> onnx.FunctionProto:
    nodes = slot_nodes() + scatter_nodes("key_cache", "k", "key_cache_out")
    nodes += scatter_nodes("value_cache", "v", "value_cache_out")
    return _function(KV_WRITE, KV_WRITE_INPUTS, ["key_cache_out", "value_cache_out"], nodes, ["block_size"])


ATTENTION_INPUTS = ["q", "key_cache", "value_cache", "block_tables", "positions"]
ATTENTION_ATTRIBUTES = ["cached_shape", "num_heads", "num_kv_heads", "scale", "window"]


def gather_nodes() -> list[onnx.NodeProto]:
    """The sequences' cached rows `key_cache_rows`, `value_cache_rows` [B, M*block_size, width]."""
    nodes = []
    for pool in ("key_cache", "value_cache"):
        nodes += [
            _node("Gather", [pool, "block_tables"], [f"{pool}_blocks"], axis=0),
            _node("Reshape", [f"{pool}_blocks", "cached_shape"], [f"{pool}_rows"]),
        ]
    return nodes


def attention_nodes(read: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`read` makes `key_cache_rows`, `value_cache_rows` (float rows in position order, from the pool)."""
    nodes = [
        _const("zero", 0),
        _const("one", 1),
        _const("minus_one", -1),
        _const("last", [-1]),
        _const("head_axis", [1]),
        _node("Constant", [], ["window"], {"value_int": ("window", INT)}),
        # A constant shape: ONNX Runtime's Attention shape inference needs the static KV width.
        _node("Constant", [], ["cached_shape"], {"value_ints": ("cached_shape", INTS)}),
        *read,
    ]
    nodes += [
        _node("Shape", ["key_cache_rows"], ["rows"], start=1, end=2),
        _node("Squeeze", ["rows"], ["rows_scalar"]),
        _node("Range", ["zero", "rows_scalar", "one"], ["key_pos"]),  # pool rows are positions 0.. in order
        _node("Unsqueeze", ["positions", "last"], ["query_pos"]),  # [B, S, 1]
        _node("LessOrEqual", ["key_pos", "query_pos"], ["causal"]),  # [B, S, L]
        _node("Sub", ["query_pos", "window"], ["window_start"]),
        _node("Greater", ["window", "zero"], ["windowed"]),
        _node("Where", ["windowed", "window_start", "minus_one"], ["lowest_excluded"]),
        _node("Greater", ["key_pos", "lowest_excluded"], ["in_window"]),
        _node("And", ["causal", "in_window"], ["visible"]),
        _node("Unsqueeze", ["visible", "head_axis"], ["mask"]),
        _node("Attention", ["q", "key_cache_rows", "value_cache_rows", "mask"], ["ctx"], {
            "q_num_heads": ("num_heads", INT), "kv_num_heads": ("num_kv_heads", INT), "scale": ("scale", FLOAT)}),
    ]  # fmt: skip
    nodes.append(_node("Constant", [], ["partials"], value_floats=[0.0]))
    return nodes


def attention_function() -> onnx.FunctionProto:
    return _function(ATTENTION, ATTENTION_INPUTS, ["ctx", "partials"], attention_nodes(gather_nodes()),
                     ATTENTION_ATTRIBUTES)  # fmt: skip


def merge_function() -> onnx.FunctionProto:
    attributes = ["num_heads", "num_kv_heads", "head_dim", "block_size"]  # the GPU kernel's; unused here
    inputs = ["ctx", "partials", "block_tables", "positions"]
    return _function(MERGE, inputs, ["ctx_out"], [_node("Identity", ["ctx"], ["ctx_out"])], attributes)


def reference_functions() -> list[onnx.FunctionProto]:
    return [prologue_function(), kv_write_function(), attention_function(), merge_function()]

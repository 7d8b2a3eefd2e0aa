"""Reference bodies of the plugin ops over a quantized KV pool (engine_format/kv_cache.py).

The float ops' contract (builder/plugin_functions.py) with the pool holding codes:
- `PagedKVWriteInt8(k, v, key_cache, value_cache, block_tables, positions, seq_lens, key_scales,
   value_scales) -> key_cache', value_cache', key_scales', value_scales'` quantizes each row per
   kv head (absmax/127) and writes its codes and scales at the row's slot;
- `PagedAttentionInt8(q, key_cache, value_cache, block_tables, positions, key_scales, value_scales)
   -> ctx, partials` reads every cached row as codes * its scale;
- `PagedKVWriteFP8(..., seq_lens, kv_scales)` / `PagedAttentionFP8(..., positions, kv_scales)`: E4M3
   codes with the static scales kv_scales[layer] (float32 [num_layers, 2]: K, V), attribute `layer`.
Attribute `kv_head_shape` is [kv_heads, head_dim]. The encodings are builder/kv_onnx.py's, so these
bodies store the bytes the portable graph and the CPU backend store.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from builder.kv_onnx import FunctionNodes, layer_scale, read_rows, write_rows
from builder.plugin_functions import (
    ATTENTION_ATTRIBUTES,
    ATTENTION_INPUTS,
    INT,
    INTS,
    KV_WRITE_INPUTS,
    _function,
    _node,
    attention_nodes,
    scatter_nodes,
    slot_nodes,
)  # fmt: skip

QUANTIZED_OPS = {  # kv dtype -> (KV write, attention)
    "int8": ("PagedKVWriteInt8", "PagedAttentionInt8"),
    "fp8": ("PagedKVWriteFP8", "PagedAttentionFP8"),
}
CACHES = ("key_cache", "value_cache")
SCALE_POOLS = ("key_scales", "value_scales")


def _extra(kind: str) -> tuple[list[str], list[str]]:
    """The quantized op's inputs and attributes beyond the float op's."""
    return (list(SCALE_POOLS), ["kv_head_shape"]) if kind == "int8" else (["kv_scales"], ["layer"])


def _scales(w: FunctionNodes, kind: str) -> list[str | None]:
    """fp8: the K and V scalar scales of the op's layer; int8: none (per-row scales)."""
    if kind == "int8":
        return [None, None]
    w.nodes.append(_node("Constant", [], ["layer_index"], {"value_int": ("layer", INT)}))
    return [layer_scale(w, "kv_scales", "layer_index", side) for side in (0, 1)]


def _heads_shape(w: FunctionNodes, leading: int) -> str:
    """int64 [0]*leading + [kv_heads, head_dim] (0 keeps a dimension)."""
    if not any(n.output[0] == "kv_head_shape" for n in w.nodes):
        w.nodes.append(_node("Constant", [], ["kv_head_shape"], {"value_ints": ("kv_head_shape", INTS)}))
    return w.op("Concat", w.const([0] * leading), "kv_head_shape", axis=0)


def kv_write_function(kind: str) -> onnx.FunctionProto:
    inputs, attributes = _extra(kind)
    w = FunctionNodes("quant")
    scales = _scales(w, kind)
    heads = _heads_shape(w, 2) if kind == "int8" else ""
    writes = []
    for rows, cache, scale_pool, scale in zip("kv", CACHES, SCALE_POOLS, scales, strict=True):
        codes, row_scales = write_rows(w, kind, w.op("Cast", rows, to=TensorProto.FLOAT), heads, scale)
        writes += scatter_nodes(cache, codes, f"{cache}_out")
        if row_scales is not None:
            writes += scatter_nodes(scale_pool, row_scales, f"{scale_pool}_out")
    outputs = [f"{c}_out" for c in CACHES] + ([f"{s}_out" for s in SCALE_POOLS] if kind == "int8" else [])
    nodes = slot_nodes() + w.nodes + writes
    return _function(QUANTIZED_OPS[kind][0], KV_WRITE_INPUTS + inputs, outputs, nodes, ["block_size", *attributes])


def attention_function(kind: str) -> onnx.FunctionProto:
    inputs, attributes = _extra(kind)
    w = FunctionNodes("dequant")
    scales = _scales(w, kind)
    heads = _heads_shape(w, 3) if kind == "int8" else ""
    for cache, scale_pool, scale in zip(CACHES, SCALE_POOLS, scales, strict=True):
        blocks = w.op("Gather", cache, "block_tables", axis=0)  # [B, M, block_size, width]
        block_scales = w.op("Gather", scale_pool, "block_tables", axis=0) if kind == "int8" else None
        rows = w.op("Reshape", read_rows(w, kind, blocks, heads, block_scales, scale), "cached_shape")
        w.op("CastLike", rows, "q", out=f"{cache}_rows")
    return _function(QUANTIZED_OPS[kind][1], ATTENTION_INPUTS + inputs, ["ctx", "partials"], attention_nodes(w.nodes),
                     ATTENTION_ATTRIBUTES + attributes)  # fmt: skip


def quantized_functions(kind: str) -> list[onnx.FunctionProto]:
    return [kv_write_function(kind), attention_function(kind)]

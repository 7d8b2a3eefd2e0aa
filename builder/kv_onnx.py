"""A quantized KV cache's row encoding and decoding as ONNX nodes.

The formats are engine_format/kv_cache.py's; these nodes compute exactly what the numpy twin
(executors/kv_quant.py) computes, op for op in float32 (absmax/127 and 127/absmax, Round
is round-half-to-even like np.rint, fp8 through Cast to FLOAT8E4M3FN after the same +-448 clip),
so the portable graph, the plugin graph's reference bodies and the CPU backend write the same pool
bytes for the same rows. They are written once over `NodeWriter`, which both the exporter's
GraphBuilder (initializer constants) and `FunctionNodes` (function bodies: Constant nodes) are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine_format.kv_cache import FP8_E4M3_MAX, INT8_MAX
from executors.kv_quant import decode_fp8 as decode_fp8_bits

# The ONNX element type of each quantized pool. fp8 pools hold E4M3 bit patterns as uint8, as the
# CPU backend's do: ONNX Runtime's CPU Gather/ScatterND take no FLOAT8E4M3FN tensors.
POOL_ELEM_TYPES = {"int8": TensorProto.INT8, "fp8": TensorProto.UINT8}
F32 = np.float32


class NodeWriter(Protocol):
    def op(self, op_type: str, *inputs: str, name: str | None = None, out: str | None = None, **attrs: Any) -> str: ...

    def const(self, value: Any, dtype: type = np.int64) -> str: ...


@dataclass
class FunctionNodes:
    """A NodeWriter collecting the nodes of an ONNX function body (constants as Constant nodes)."""

    prefix: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    _count: int = 0

    def _fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}_{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, name: str | None = None, out: str | None = None, **attrs: Any) -> str:
        output = out or self._fresh(op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=name or output, **attrs))
        return output

    def const(self, value: Any, dtype: type = np.int64) -> str:
        output = self._fresh("const")
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype), output)
        self.nodes.append(helper.make_node("Constant", [], [output], value=tensor))
        return output


def quantize_int8(g: NodeWriter, heads: str) -> tuple[str, str]:
    """heads float32 [..., kv_heads, head_dim] -> (int8 codes, same shape; float32 scales [..., kv_heads]):
    scale = absmax / 127, code = clip(round(x * (127 / absmax)), +-127), an all-zero head codes 0."""
    absmax = g.op("ReduceMax", g.op("Abs", heads), g.const([-1]), keepdims=0)
    limit, zero = g.const(INT8_MAX, F32), g.const(0.0, F32)
    scales = g.op("Div", absmax, limit)
    inverse = g.op("Where", g.op("Greater", absmax, zero), g.op("Div", limit, absmax), zero)
    scaled = g.op("Round", g.op("Mul", heads, g.op("Unsqueeze", inverse, g.const([-1]))))
    codes = g.op("Cast", g.op("Clip", scaled, g.const(-INT8_MAX, F32), limit), to=TensorProto.INT8)
    return codes, scales


def dequantize_int8(g: NodeWriter, codes: str, scales: str) -> str:
    """codes int8 [..., kv_heads, head_dim], scales [..., kv_heads] -> float32 codes * scale."""
    return g.op("Mul", g.op("Cast", codes, to=TensorProto.FLOAT), g.op("Unsqueeze", scales, g.const([-1])))


def encode_fp8(g: NodeWriter, values: str, scale: str) -> str:
    """float32 values / scale as E4M3 (fn) bit patterns (uint8): clipped to +-448, then rounded to
    nearest even by ONNX Runtime's Cast to FLOAT8E4M3FN; its bits come from the exact value (no ONNX op
    reinterprets bytes): biased exponent E = #{k in -6..8 : |v| >= 2^k}, mantissa |v| / 2^(max(E,1)-10)
    - 8 [E > 0], sign from 1/v (so -0 keeps its sign bit, as ml_dtypes does)."""
    limit = FP8_E4M3_MAX
    scaled = g.op("Clip", g.op("Div", values, scale), g.const(-limit, F32), g.const(limit, F32))
    fp8 = g.op("Cast", scaled, to=TensorProto.FLOAT8E4M3FN, saturate=1)
    value = g.op("Cast", fp8, to=TensorProto.FLOAT)
    size = g.op("Abs", value)
    powers = g.const(np.exp2(np.arange(-6, 9)), F32)  # the smallest normal of each exponent
    at_least = g.op(
        "Cast", g.op("GreaterOrEqual", g.op("Unsqueeze", size, g.const([-1])), powers), to=TensorProto.FLOAT
    )
    exponent = g.op("ReduceSum", at_least, g.const([-1]), keepdims=0)  # 0 (subnormal) .. 15
    steps = g.const(np.exp2(10 - np.maximum(np.arange(16), 1)), F32)  # 1 / the mantissa step, per exponent
    step = g.op("Gather", steps, g.op("Cast", exponent, to=TensorProto.INT64))
    implicit = g.op("Mul", g.op("Cast", g.op("Greater", exponent, g.const(0.0, F32)), to=TensorProto.FLOAT),
                    g.const(8.0, F32))  # fmt: skip
    mantissa = g.op("Sub", g.op("Mul", size, step), implicit)
    negative = g.op("Less", g.op("Div", g.const(1.0, F32), value), g.const(0.0, F32))
    sign = g.op("Mul", g.op("Cast", negative, to=TensorProto.FLOAT), g.const(128.0, F32))
    code = g.op("Add", g.op("Add", g.op("Mul", exponent, g.const(8.0, F32)), mantissa), sign)
    return g.op("Cast", code, to=TensorProto.UINT8)


def decode_fp8(g: NodeWriter, bits: str, scale: str) -> str:
    """E4M3 bits (uint8) -> float32 value * scale, through the 256-entry table of E4M3 values."""
    table = g.const(decode_fp8_bits(np.arange(256, dtype=np.uint8)), F32)  # NaN at 0x7F, 0xFF
    return g.op("Mul", g.op("Gather", table, g.op("Cast", bits, to=TensorProto.INT32)), scale)


def layer_scale(g: NodeWriter, kv_scales: str, layer: str, side: int) -> str:
    """fp8: the scalar scale of `layer` (an int64 scalar tensor) and side 0 (K) or 1 (V) of
    kv_scales float32 [num_layers, 2]."""
    return g.op("Gather", g.op("Gather", kv_scales, layer, axis=0), g.const(side), axis=0)


def write_rows(g: NodeWriter, kind: str, rows: str, heads_shape: str, scale: str | None) -> tuple[str, str | None]:
    """This step's rows float32 [..., kv_width] -> (the codes to store, same shape; int8: their
    scales [..., kv_heads]). `heads_shape`: int64 [..., kv_heads, head_dim] of rows (0 copies a dim)."""
    if kind == "fp8":
        assert scale is not None
        return encode_fp8(g, rows, scale), None
    codes, scales = quantize_int8(g, g.op("Reshape", rows, heads_shape))
    return g.op("Reshape", codes, g.op("Shape", rows)), scales


def read_rows(g: NodeWriter, kind: str, codes: str, heads_shape: str, scales: str | None, scale: str | None) -> str:
    """Stored codes [..., kv_width] (with their int8 scales [..., kv_heads] or fp8 scale) -> float32
    rows, the same shape as `codes`."""
    if kind == "fp8":
        assert scale is not None
        return decode_fp8(g, codes, scale)
    assert scales is not None
    values = dequantize_int8(g, g.op("Reshape", codes, heads_shape), scales)
    return g.op("Reshape", values, g.op("Shape", codes))

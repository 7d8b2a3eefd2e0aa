"""A quantized KV cache's encodings inside the Triton kernels (formats: engine_format/kv_cache.py).

The writes compute what executors/kv_quant.py computes, bit for bit: IEEE divisions
(`div_rn`; a plain `/` is approximate on the GPU), round half to even, and the kernels that
quantize are compiled without FMA contraction (a fused x * inverse + rounding constant would
round once instead of twice). fp8 is encoded and decoded with integer arithmetic on the E4M3
(fn) bit pattern rather than through tl.float8e4nv: it runs on every architecture the plugins are
built for (sm_80 has no fp8 conversions), in the interpreter too, and pins the rounding. The
attention kernels decode in registers: int8 code * its row's scale, fp8 value * the layer's scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Adding then subtracting 1.5 * 2^23 rounds |y| < 2^22 to an integer, half to even (np.rint):
# the sum lies where float32's spacing is 1, so the addition itself rounds.
ROUNDING = tl.constexpr(12582912.0)
INT8_LIMIT = tl.constexpr(127.0)
FP8_LIMIT = tl.constexpr(448.0)
FP8_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6
FP8_SUBNORMAL_STEP = tl.constexpr(0.001953125)  # 2^-9


@triton.jit
def round_half_even(y):
    return (y + ROUNDING) - ROUNDING


@triton.jit
def quantize_int8(x):
    """x float32 [heads, head_dim] -> (codes int8, same shape; scales float32 [heads]):
    scale = absmax / 127, code = clip(rint(x * (127 / absmax)), +-127); an all-zero head codes 0."""
    absmax = tl.max(tl.abs(x), axis=1)
    scales = tl.math.div_rn(absmax, tl.full(absmax.shape, INT8_LIMIT, tl.float32))
    nonzero = absmax > 0
    inverse = tl.math.div_rn(tl.full(absmax.shape, INT8_LIMIT, tl.float32), tl.where(nonzero, absmax, 1.0))
    inverse = tl.where(nonzero, inverse, 0.0)
    codes = tl.minimum(tl.maximum(round_half_even(x * inverse[:, None]), -INT8_LIMIT), INT8_LIMIT)
    return codes.to(tl.int8), scales


@triton.jit
def encode_fp8(x, scale):
    """float32 x / scale as E4M3 (fn) bits (uint8): clipped to +-448, rounded to nearest even."""
    y = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * scale)
    y = tl.minimum(tl.maximum(y, -FP8_LIMIT), FP8_LIMIT)
    bits = y.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # Normal results: float32's 23 mantissa bits rounded to 3 (half to even; a carry bumps the
    # exponent), the exponent rebiased from 127 to 7 (120 << 3 = 960).
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - 960
    # Subnormal results (|y| < 2^-6): the count of 2^-9 steps, 0..8 (8 is the smallest normal's code).
    size = magnitude.to(tl.float32, bitcast=True)
    subnormal = round_half_even(size * 512.0).to(tl.uint32)
    code = tl.where(size < FP8_MIN_NORMAL, subnormal, normal) | ((bits >> 31) << 7)
    return code.to(tl.uint8)


@triton.jit
def decode_fp8(bits):
    """E4M3 (fn) bits (uint8) -> float32 (NaN for 0x7F/0xFF, which encode_fp8 never writes)."""
    b = bits.to(tl.uint32)
    exponent = (b >> 3) & 15
    mantissa = b & 7
    sign = (b >> 7) << 31
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * FP8_SUBNORMAL_STEP
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((b & 127) == 127, float("nan"), value)


@triton.jit
def dequantize(x, scales_ptr, scale_rows, scale, ok, KV_QUANT: tl.constexpr):
    """Pool tiles [N, D] as float32: KV_QUANT 1 (int8) codes * scales_ptr[scale_rows] (one per row,
    rows not `ok` read 0), 2 (fp8) decoded * the scalar `scale`; 0 (a float pool) x as it is."""
    out = x
    if KV_QUANT == 1:
        out = x.to(tl.float32) * tl.load(scales_ptr + scale_rows, mask=ok, other=0.0)[:, None]
    if KV_QUANT == 2:
        out = decode_fp8(x) * scale
    return out

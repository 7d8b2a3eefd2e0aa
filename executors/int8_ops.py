"""The cpu-int8 backend's dense layers, in the kernel module (executors/kernels/int8_linear.h): weights packed
once as int8 per output channel, each layer input quantized per token to uint8 in the pass that produces it
(RMSNorm, the MLP's gating, or a plain copy), and W8A8 matmuls whose epilogue dequantizes, adds a bias and
accumulates into the residual stream. numpy in and out; the numpy reference is in tests/test_int8_ops.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_format import ceil_div
from executors.cpu_attention import kernel_module
from executors.cpus import usable_cpus

_kernel = kernel_module()
STRIP = 16  # output columns per packed strip (int8_linear.h INT8_STRIP)


def simd_isa() -> str:
    """The vector loops the matmuls run here: "avx512-vnni", "avx2", or "" (the same layout as plain loops:
    correct, slow)."""
    return str(_kernel.int8_simd())


@dataclass(frozen=True)
class PackedLinear:
    """A [K, N] weight as int8 strips: [N/16][K/4][16 columns][4 k] (K padded to 4, N to 16, with zeros)."""

    packed: np.ndarray  # int8 [ceil(N/16), Kp/4, 16, 4]
    scale: np.ndarray  # float32 [N]: per output channel, max |w| / 127
    colsum: np.ndarray  # int32 [N]: sum over k of the int8 weights (the activations' zero-point correction)
    bias: np.ndarray | None  # float32 [N]
    in_features: int
    out_features: int

    @property
    def padded_in(self) -> int:
        return self.packed.shape[1] * 4

    @classmethod
    def pack(cls, weight: np.ndarray, bias: np.ndarray | None = None) -> PackedLinear:
        """Quantize a float [in, out] weight (the graph's MatMul layout) symmetrically per output channel."""
        k, n = weight.shape
        w = np.asarray(weight, np.float32)
        scale = np.abs(w).max(axis=0) / np.float32(127)
        scale[scale == 0] = 1.0  # an all-zero column: any scale
        codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        kp, np_ = ceil_div(k, 4) * 4, ceil_div(n, STRIP) * STRIP
        padded = np.zeros((kp, np_), np.int8)
        padded[:k, :n] = codes
        packed = np.ascontiguousarray(padded.reshape(kp // 4, 4, np_ // STRIP, STRIP).transpose(2, 0, 3, 1))
        colsum = codes.astype(np.int32).sum(axis=0, dtype=np.int32)
        b = None if bias is None else np.ascontiguousarray(bias, np.float32)
        return cls(packed, scale.astype(np.float32), colsum, b, k, n)

    def dequantized(self) -> np.ndarray:
        """float32 [in, out]: the weight this packing computes with (tests, references)."""
        strips, k4 = self.packed.shape[:2]
        codes = self.packed.transpose(1, 3, 0, 2).reshape(k4 * 4, strips * STRIP)
        return codes[: self.in_features, : self.out_features].astype(np.float32) * self.scale


@dataclass(frozen=True)
class QuantizedRows:
    """Activations per token: x[t] ~ scale[t] * (codes[t] - zero_point[t]), codes uint8 [T, Kp]."""

    codes: np.ndarray
    scale: np.ndarray  # float32 [T]
    zero_point: np.ndarray  # int32 [T]

    @classmethod
    def empty(cls, tokens: int, padded_in: int) -> QuantizedRows:
        return cls(np.empty((tokens, padded_in), np.uint8), np.empty(tokens, np.float32), np.empty(tokens, np.int32))

    def buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.codes, self.scale, self.zero_point

    def dequantized(self, in_features: int) -> np.ndarray:
        return (self.codes[:, :in_features].astype(np.float32) - self.zero_point[:, None]) * self.scale[:, None]


def _rows(x: np.ndarray, name: str) -> np.ndarray:
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous float32 [tokens, features], got {x.dtype} {x.shape}")
    return x


def quantize_rows(x: np.ndarray, padded_in: int, multiplier: np.ndarray | None = None) -> QuantizedRows:
    """Rows [T, K] (each channel times `multiplier` [K] first, if given) quantized per token (asymmetric over
    [min(x, 0), max(x, 0)], round half to even)."""
    _rows(x, "x")
    if multiplier is not None and (multiplier.dtype != np.float32 or multiplier.shape != (x.shape[1],)):
        raise ValueError(f"multiplier must be float32 [{x.shape[1]}], got {multiplier.dtype} {multiplier.shape}")
    out = QuantizedRows.empty(x.shape[0], padded_in)
    _kernel.quantize_rows(x, x.shape[1], x.shape[0], x.shape[1], padded_in, multiplier, *out.buffers())
    return out


SMOOTHING_ALPHA = 0.5  # SmoothQuant's migration strength: half of each channel's activation range moves to weights


def smoothing(activation_absmax: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """SmoothQuant's per-input-channel factors s [in] for a weight [in, out] whose input channels reach
    `activation_absmax` on calibration text: the input is divided by s and the weight's rows multiplied by it
    (the product unchanged), so outlier channels no longer set every token's quantization step.
    s = absmax^a / max|w|^(1 - a), a = SMOOTHING_ALPHA; SmolLM2 with per-token int8: mean KL 0.022 -> 0.009."""
    a = SMOOTHING_ALPHA
    weight_max = np.abs(weight).max(axis=1)
    s = np.maximum(activation_absmax, 1e-5) ** a / np.maximum(weight_max, 1e-5) ** (1 - a)
    return np.maximum(s, 1e-5).astype(np.float32)


def rms_norm_quantize(x: np.ndarray, weight: np.ndarray, eps: float, padded_in: int) -> QuantizedRows:
    """HF Llama's RMSNorm of float32 rows, quantized per token."""
    _rows(x, "x")
    if weight.dtype != np.float32 or weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be float32 [{x.shape[1]}], got {weight.dtype} {weight.shape}")
    out = QuantizedRows.empty(x.shape[0], padded_in)
    _kernel.rms_norm_quantize(x, weight, x.shape[0], x.shape[1], padded_in, eps, *out.buffers())
    return out


def silu_mul_quantize(gate_up: np.ndarray, padded_in: int) -> QuantizedRows:
    """silu(gate) * up over gate_up rows [T, 2 I] (gate | up), quantized per token."""
    _rows(gate_up, "gate_up")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must hold gate and up halves, got width {gate_up.shape[1]}")
    out = QuantizedRows.empty(gate_up.shape[0], padded_in)
    _kernel.silu_mul_quantize(gate_up, gate_up.shape[0], gate_up.shape[1] // 2, padded_in, *out.buffers())
    return out


def linear(
    rows: QuantizedRows,
    weight: PackedLinear,
    out: np.ndarray | None = None,
    accumulate: bool = False,
    threads: int | None = None,
    simd: bool = True,
) -> np.ndarray:
    """rows @ weight (+ bias) as float32 [T, N] into `out` (new if None), or added to it (`accumulate`: the
    residual connections). `simd=False` runs the portable loops (tests compare the two)."""
    tokens = rows.codes.shape[0]
    if rows.codes.shape[1] != weight.padded_in:
        raise ValueError(f"rows are quantized for {rows.codes.shape[1]} inputs, the weight takes {weight.padded_in}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs an out array to add to")
        out = np.empty((tokens, weight.out_features), np.float32)
    elif out.dtype != np.float32 or out.shape != (tokens, weight.out_features) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 [{tokens}, {weight.out_features}], got {out.shape}")
    _kernel.int8_linear(
        rows.codes,
        tokens,
        weight.padded_in,
        rows.scale,
        rows.zero_point,
        weight.packed,
        weight.out_features,
        weight.scale,
        weight.colsum,
        weight.bias,
        out,
        weight.out_features,
        accumulate,
        threads or usable_cpus(),
        simd,
    )
    return out


def rope_split(
    qkv: np.ndarray, heads: int, kv_heads: int, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fused QKV rows [T, (heads + 2 kv_heads) D] float32 -> q [T, heads D] and k [T, kv_heads D] rotated at
    `positions`, and v [T, kv_heads D]. cos, sin: float32 [max_positions, D] tables of the rotate-half form
    (x * cos + [x2, x1] * sin; sin's first half negated)."""
    _rows(qkv, "qkv")
    tokens, head_dim = qkv.shape[0], cos.shape[1]
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or sin.shape != cos.shape or cos.dtype != np.float32:
        raise ValueError(f"qkv {qkv.shape} does not match {heads} + 2 x {kv_heads} heads of {head_dim}")
    pos = np.ascontiguousarray(positions, np.int64)
    if pos.shape != (tokens,) or (tokens and (pos.min() < 0 or pos.max() >= cos.shape[0])):
        raise ValueError(f"positions must be [{tokens}] in [0, {cos.shape[0]})")
    q = np.empty((tokens, heads * head_dim), np.float32)
    k = np.empty((tokens, kv_heads * head_dim), np.float32)
    v = np.empty_like(k)
    _kernel.rope_split_f32(qkv, tokens, heads, kv_heads, head_dim, cos, sin, cos.shape[0], pos, q, k, v)
    return q, k, v

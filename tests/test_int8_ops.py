"""The cpu-int8 backend's kernel (executors/kernels/int8_linear.h through executors/int8_ops.py) against numpy
references: packing, per-token quantization, the W8A8 matmul in float64, the fused RMSNorm / SiLU-gating passes,
the float32 RoPE split; the vector loops (AVX512-VNNI or AVX2) against the portable ones; bad buffers refused,
never read past."""

from __future__ import annotations

import numpy as np
import pytest

from executors import int8_ops
from executors.int8_ops import PackedLinear, QuantizedRows


def ref_quantize(x: np.ndarray, padded_in: int) -> QuantizedRows:
    """Per token, asymmetric over [min(x, 0), max(x, 0)], round half to even: the kernel's formula in numpy."""
    lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
    scale = ((hi - lo) * np.float32(1 / 255)).astype(np.float32)
    scale[scale <= 0] = 1
    inv = np.float32(1) / scale
    zp = np.rint(-lo * inv)
    codes = np.zeros((x.shape[0], padded_in), np.uint8)
    codes[:, : x.shape[1]] = np.clip(np.rint(x * inv[:, None]) + zp[:, None], 0, 255)
    codes[:, x.shape[1] :] = zp[:, None]
    return QuantizedRows(codes, scale, zp.astype(np.int32))


def ref_linear(rows: QuantizedRows, weight: PackedLinear) -> np.ndarray:
    """float64 product of exactly the operands the kernel multiplies (dequantized activations and weights)."""
    y = rows.dequantized(weight.in_features).astype(np.float64) @ weight.dequantized().astype(np.float64)
    return y if weight.bias is None else y + weight.bias


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_packing_is_per_output_channel_and_round_trips():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 21)).astype(np.float32)  # K, N padded to 40 and 32
    w[:, 5] = 0  # an all-zero channel
    packed = PackedLinear.pack(w)
    assert packed.packed.shape == (2, 10, 16, 4) and packed.padded_in == 40
    np.testing.assert_allclose(packed.scale[np.arange(21) != 5], np.abs(w).max(axis=0)[np.arange(21) != 5] / 127)
    deq = packed.dequantized()
    assert np.all(np.abs(deq - w) <= packed.scale / 2 + 1e-7)  # round to nearest
    codes = np.rint(deq / packed.scale).astype(np.int32)
    assert codes.min() >= -127 and codes.max() <= 127 and np.abs(codes).max(axis=0)[0] == 127
    np.testing.assert_array_equal(packed.colsum, codes.sum(axis=0))


def test_quantize_rows_matches_the_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 50)).astype(np.float32) * rng.uniform(0.1, 10, (9, 1)).astype(np.float32)
    x[3] = 0  # all zero: scale 1, codes 0
    x[4] = np.abs(x[4])  # no negative value: the range still holds 0
    got, want = int8_ops.quantize_rows(x, 52), ref_quantize(x, 52)
    np.testing.assert_array_equal(got.scale, want.scale)
    np.testing.assert_array_equal(got.zero_point, want.zero_point)
    assert np.abs(got.codes.astype(int) - want.codes).max() <= 1  # a half-way tie may round either side
    assert (got.codes != want.codes).mean() < 0.01
    assert np.all(np.abs(got.dequantized(50) - x) <= got.scale[:, None] * 0.51)
    assert (got.zero_point[3], got.scale[3]) == (0, 1.0) and got.zero_point[4] == 0


@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 40])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (37, 21), (96, 200)])
def test_linear_equals_float64_over_its_operands(tokens, k, n):
    """Every row tile (VNNI: 16, 8, 4, 2, 1 rows; AVX2: 6, 4, 2, 1), K and N padding, a bias, and accumulation
    into `out`."""
    rng = np.random.default_rng(tokens * 1000 + k)
    weight = PackedLinear.pack(
        rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    )
    rows = int8_ops.quantize_rows(rng.standard_normal((tokens, k)).astype(np.float32), weight.padded_in)
    want = ref_linear(rows, weight)
    got = int8_ops.linear(rows, weight)
    assert relative_error(got, want) < 1e-5
    assert relative_error(int8_ops.linear(rows, weight, simd=False), want) < 1e-5  # the portable loops
    residual = rng.standard_normal((tokens, n)).astype(np.float32)
    out = residual.copy()
    int8_ops.linear(rows, weight, out, accumulate=True)
    assert relative_error(out, residual + want) < 1e-5


def test_sums_are_exact_where_byte_pairs_would_saturate_16_bits():
    """Codes 255 x weights 127: a pair of such products (64,770) overflows int16, as AVX2's vpmaddubsw would leave
    it (saturated at 32,767, half the sum); the kernel's sums are exact, in the vector loops as in the plain ones."""
    k, n = 96, 24
    weight = PackedLinear.pack(np.full((k, n), 0.5, np.float32))
    rows = int8_ops.quantize_rows(np.full((6, k), 3.0, np.float32), weight.padded_in)
    assert rows.codes[:, :k].min() == 255 and weight.dequantized().min() == pytest.approx(0.5)
    want = np.full((6, n), 3.0 * 0.5 * k)
    for simd in (True, False):
        assert relative_error(int8_ops.linear(rows, weight, simd=simd), want) < 1e-6


def test_the_kernel_has_the_vector_loops_the_cpu_flags_promise():
    """Builds gate cpu-int8, and serving defaults to it, where executors.cpus.int8_simd() reads the flags: the
    kernel built here must then run vector loops, not the portable ones."""
    from executors.cpus import int8_simd

    assert bool(int8_ops.simd_isa()) == int8_simd()
    assert int8_ops.simd_isa() in ("avx512-vnni", "avx2", "")


def test_the_comparison_catches_a_wrong_channel_scale():
    """The reference check can fail: one output channel's scale off by 2x is found."""
    rng = np.random.default_rng(2)
    weight = PackedLinear.pack(rng.standard_normal((64, 32)).astype(np.float32))
    rows = int8_ops.quantize_rows(rng.standard_normal((4, 64)).astype(np.float32), weight.padded_in)
    want = ref_linear(rows, weight)
    weight.scale[7] *= 2
    assert relative_error(int8_ops.linear(rows, weight), want) > 0.1


def test_w8a8_is_close_to_the_float_product():
    """What the quantization costs against float64 of the unquantized operands: ~1% of the largest output."""
    rng = np.random.default_rng(3)
    w, x = rng.standard_normal((576, 960)).astype(np.float32), rng.standard_normal((16, 576)).astype(np.float32)
    weight = PackedLinear.pack(w)
    got = int8_ops.linear(int8_ops.quantize_rows(x, weight.padded_in), weight)
    assert relative_error(got, x.astype(np.float64) @ w) < 0.03


def test_rms_norm_and_silu_gating_quantize_their_outputs():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 48)).astype(np.float32) * 3
    w = rng.uniform(0.5, 2, 48).astype(np.float32)
    normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    got = int8_ops.rms_norm_quantize(x, w, 1e-5, 48)
    assert np.all(np.abs(got.dequantized(48) - normed) <= got.scale[:, None] * 0.51 + 1e-6)
    gate_up = rng.standard_normal((5, 2 * 24)).astype(np.float32) * 2
    g, u = gate_up[:, :24].astype(np.float64), gate_up[:, 24:]
    gated = g / (1 + np.exp(-g)) * u
    got = int8_ops.silu_mul_quantize(gate_up, 24)
    assert np.all(np.abs(got.dequantized(24) - gated) <= got.scale[:, None] * 0.51 + 1e-6)


def test_rope_split_rotates_q_and_k_and_copies_v():
    rng = np.random.default_rng(5)
    heads, kv_heads, d, positions = 3, 1, 8, np.array([0, 5, 2])
    qkv = rng.standard_normal((3, (heads + 2 * kv_heads) * d)).astype(np.float32)
    angle = np.arange(10)[:, None] * rng.uniform(0.1, 1, d // 2)[None, :]
    cos = np.concatenate([np.cos(angle)] * 2, axis=1).astype(np.float32)
    sin = np.concatenate([-np.sin(angle), np.sin(angle)], axis=1).astype(np.float32)
    q, k, v = int8_ops.rope_split(qkv, heads, kv_heads, cos, sin, positions)
    heads_in = qkv.reshape(3, heads + 2 * kv_heads, d)
    rotated = np.concatenate([heads_in[..., d // 2 :], heads_in[..., : d // 2]], axis=-1)
    want = heads_in * cos[positions][:, None] + rotated * sin[positions][:, None]
    np.testing.assert_allclose(q, want[:, :heads].reshape(3, -1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k, want[:, heads : heads + kv_heads].reshape(3, -1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(v, heads_in[:, heads + kv_heads :].reshape(3, -1))


def test_bad_buffers_are_refused_not_read():
    rng = np.random.default_rng(6)
    weight = PackedLinear.pack(rng.standard_normal((64, 32)).astype(np.float32))
    rows = int8_ops.quantize_rows(rng.standard_normal((4, 64)).astype(np.float32), weight.padded_in)
    with pytest.raises(ValueError, match="float32"):
        int8_ops.quantize_rows(np.zeros((4, 64)), 64)  # float64
    with pytest.raises(ValueError, match="C-contiguous"):
        int8_ops.quantize_rows(np.zeros((64, 4), np.float32).T, 64)
    with pytest.raises(ValueError, match="quantized for 68 inputs"):
        int8_ops.linear(int8_ops.quantize_rows(np.zeros((4, 64), np.float32), 68), weight)
    with pytest.raises(ValueError, match="out must be"):
        int8_ops.linear(rows, weight, np.zeros((4, 31), np.float32))
    short = QuantizedRows(rows.codes, rows.scale[:2], rows.zero_point)  # fewer scales than rows
    with pytest.raises(ValueError, match="scale holds 8 bytes"):
        int8_ops.linear(short, weight)


def test_smoothing_keeps_the_product_and_tames_an_outlier_channel():
    """SmoothQuant's factors: (x / s) @ (s w) is x @ w, and with one outlier input channel (as LLM activations
    have) the per-token quantization error falls by more than half: without them the outlier sets every
    token's step."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[:, 3] *= 60  # an outlier channel
    w = rng.standard_normal((256, 128)).astype(np.float32) * 0.05
    s = int8_ops.smoothing(np.abs(x).max(axis=0), w)
    np.testing.assert_allclose((x / s) @ (w * s[:, None]).astype(np.float64), x.astype(np.float64) @ w, rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    exact = x.astype(np.float64) @ w
    plain = PackedLinear.pack(w)
    plain_error = relative_error(int8_ops.linear(int8_ops.quantize_rows(x, plain.padded_in), plain), exact)
    smoothed = PackedLinear.pack(w * s[:, None])
    rows = int8_ops.quantize_rows(x, smoothed.padded_in, multiplier=(1 / s).astype(np.float32))
    smoothed_error = relative_error(int8_ops.linear(rows, smoothed), exact)
    assert smoothed_error < plain_error / 2, (smoothed_error, plain_error)

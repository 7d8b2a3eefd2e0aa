"""Quantized KV pools (int8 row scales, fp8 E4M3 layer scales): the codecs and the CPU kernel
against a numpy reference that dequantizes the pool explicitly and runs float attention."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from engine_format.kv_cache import FP8_E4M3_MAX
from runtime.backends.cpu_attention import AttentionShape, paged_attention
from runtime.backends.kv_quant import KVQuant, decode_fp8, dequantize_int8, encode_fp8, quantize_int8
from tests.test_paged_attention import SHAPES, make_case, reference

SEQS = [(0, 1), (5, 1), (37, 1), (0, 23), (19, 9), (64, 1)]  # decodes, a prefill, a chunk after a prefix
IDS = [f"h{s.num_heads}kv{s.num_kv_heads}d{s.head_dim}b{s.block_size}" for s in SHAPES]


def quantize_pool(kind: str, k_cache: np.ndarray, v_cache: np.ndarray, kv_heads: int):
    """(k codes, v codes, KVQuant, k dequantized, v dequantized): the pool as the kernel reads it and
    as the reference reads it (dequantized here, element by element, not by the kernel's code)."""
    blocks, bs, width = k_cache.shape
    if kind == "int8":
        (kq, ks), (vq, vs) = (quantize_int8(c.reshape(-1, width), kv_heads) for c in (k_cache, v_cache))
        kq, vq = kq.reshape(k_cache.shape), vq.reshape(k_cache.shape)
        ks, vs = ks.reshape(blocks, bs, kv_heads), vs.reshape(blocks, bs, kv_heads)
        quant = KVQuant("int8", ks, vs)
        kd = (kq.reshape(blocks, bs, kv_heads, -1).astype(np.float64) * ks[..., None]).reshape(k_cache.shape)
        vd = (vq.reshape(blocks, bs, kv_heads, -1).astype(np.float64) * vs[..., None]).reshape(k_cache.shape)
        return kq, vq, quant, kd.astype(np.float32), vd.astype(np.float32)
    k_scale, v_scale = float(np.abs(k_cache).max()) / FP8_E4M3_MAX, float(np.abs(v_cache).max()) / FP8_E4M3_MAX
    kq, vq = encode_fp8(k_cache, k_scale), encode_fp8(v_cache, v_scale)
    to_float = torch.from_numpy(kq.copy()).view(torch.float8_e4m3fn).float().numpy()
    to_float_v = torch.from_numpy(vq.copy()).view(torch.float8_e4m3fn).float().numpy()
    return kq, vq, KVQuant("fp8", k_scale=k_scale, v_scale=v_scale), to_float * k_scale, to_float_v * v_scale


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_matches_dequantized_reference(kind, shape, window):
    """Decodes at several depths, a prefill, a prefill chunk after a prefix; GQA, MHA, MQA; windows."""
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(0), shape, SEQS)
    kq, vq, quant, kd, vd = quantize_pool(kind, k, v, shape.num_kv_heads)
    got = paged_attention(q, kq, vq, tables, seqs, pos, shape, window=window, quant=quant)
    np.testing.assert_allclose(got, reference(q, kd, vd, tables, seqs, pos, shape, window=window), atol=3e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_attention_stays_close_to_float(kind):
    """The end-to-end error of the format (not the kernel's): quantized vs fp32 pool, SmolLM2 shape."""
    shape = SHAPES[0]
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(1), shape, SEQS)
    kq, vq, quant, _, _ = quantize_pool(kind, k, v, shape.num_kv_heads)
    exact = paged_attention(q, k, v, tables, seqs, pos, shape)
    error = np.abs(paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=quant) - exact).max()
    assert error < {"int8": 0.04, "fp8": 0.2}[kind], error  # measured 0.020 / 0.112 (outputs: std 0.47)


@pytest.mark.parametrize("which", ["k", "v"])
def test_a_corrupted_scale_is_caught(which):
    """The kernel reads the scales: doubling one row's scale moves the output of the token that
    attends to it (a kernel ignoring scales would pass the reference test only by luck)."""
    shape = SHAPES[1]
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(2), shape, [(30, 1)])
    kq, vq, quant, kd, vd = quantize_pool("int8", k, v, shape.num_kv_heads)
    want = reference(q, kd, vd, tables, seqs, pos, shape)
    np.testing.assert_allclose(paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=quant), want, atol=3e-5)
    scales = (quant.k_scales if which == "k" else quant.v_scales).copy()
    block = tables[0, 1]
    scales[block, 3] *= 2.0
    broken = KVQuant("int8", scales, quant.v_scales) if which == "k" else KVQuant("int8", quant.k_scales, scales)
    assert np.abs(paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=broken) - want).max() > 1e-3


def test_fp8_layer_scale_is_applied():
    shape = SHAPES[1]
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(3), shape, [(30, 1)])
    kq, vq, quant, kd, vd = quantize_pool("fp8", k, v, shape.num_kv_heads)
    want = reference(q, kd, vd, tables, seqs, pos, shape)
    doubled = KVQuant("fp8", k_scale=quant.k_scale, v_scale=2 * quant.v_scale)
    got = paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=doubled)
    np.testing.assert_allclose(got, 2 * want, rtol=1e-4, atol=1e-5)


def test_int8_round_trip_error_is_within_half_a_step():
    rows = np.random.default_rng(4).standard_normal((500, 3 * 64)).astype(np.float32) * 5
    rows[7, :64] = 0.0  # an all-zero head: scale 0, codes 0, exact
    codes, scales = quantize_int8(rows, 3)
    assert codes.dtype == np.int8 and scales.shape == (500, 3) and np.abs(codes).max() <= 127
    back = dequantize_int8(codes, scales)
    step = np.repeat(scales, 64, axis=1)
    assert np.all(np.abs(back - rows) <= step / 2 + 1e-6)
    np.testing.assert_array_equal(back[7, :64], 0.0)
    assert np.abs(codes.reshape(500, 3, 64)).max(-1).min() == 127 or scales.min() == 0  # absmax maps to 127


def test_fp8_codec_matches_torch_e4m3fn_and_saturates():
    every = np.arange(256, dtype=np.uint8)
    ours = decode_fp8(every)
    theirs = torch.from_numpy(every.copy()).view(torch.float8_e4m3fn).float().numpy()
    finite = ~np.isnan(theirs)
    np.testing.assert_array_equal(ours[finite], theirs[finite])
    values = np.random.default_rng(5).standard_normal(10_000).astype(np.float32) * 100
    values[:3] = [1e6, -1e6, 448.0]
    bits = encode_fp8(values, 1.0)
    want = torch.from_numpy(np.clip(values, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(bits, want)
    assert decode_fp8(bits[:2]).tolist() == [448.0, -448.0]  # saturated, not NaN
    relative = np.abs(decode_fp8(bits[3:]) - values[3:]) / np.maximum(np.abs(values[3:]), 2.0**-6)
    assert relative.max() <= 2.0**-4 + 1e-6  # 3 mantissa bits: half an ulp
    assert bits.dtype == np.uint8 and ml_dtypes.float8_e4m3fn(448.0) == 448.0


@pytest.mark.parametrize(
    ("quant", "cache_dtype", "message"),
    [
        (KVQuant("int8"), np.int8, "int8 scales must be"),
        (KVQuant("int8", np.ones((64, 8, 4), np.float32), np.ones((64, 8, 4), np.float32)), np.float32,
         "k/v cache must be C-contiguous int8"),
        (KVQuant("int4"), np.int8, "k/v cache must be C-contiguous float32"),
    ],
)  # fmt: skip
def test_mismatched_pool_and_scales_are_refused(quant, cache_dtype, message):
    shape = AttentionShape(num_heads=4, num_kv_heads=4, head_dim=16, block_size=8)
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(6), shape, [(3, 2)])
    with pytest.raises(ValueError, match=message):
        paged_attention(q, k.astype(cache_dtype), v.astype(cache_dtype), tables, seqs, pos, shape, quant=quant)

"""Quantized KV pools (int8 row scales, fp8 E4M3 layer scales): the codecs and the CPU kernel
against a numpy reference that dequantizes the pool explicitly and runs float attention."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from engine_format import EngineConfig, ModelSpec
from engine_format.kv_cache import FP8_E4M3_MAX
from executors.cpu_attention import AttentionShape, paged_attention, write_kv
from executors.kv_pool import KVPool, pool_rows
from executors.kv_quant import KVQuant, decode_fp8, dequantize_int8, encode_fp8, quantize_int8
from tests.test_paged_attention import SHAPES, make_case, reference

SEQS = [(0, 1), (5, 1), (37, 1), (0, 23), (19, 9), (64, 1)]  # decodes, a prefill, a chunk after a prefix
IDS = [f"h{s.num_heads}kv{s.num_kv_heads}d{s.head_dim}b{s.block_size}" for s in SHAPES]
# The AMX tiles' tolerance (outputs ~1): the query and p x value scale carry ~16 bits there, each within
# ~1e-4 of the output (a numpy model of the arithmetic: 1.4e-4 relative at worst over 50 draws), far
# below int8 storage's own error (~2e-2: test_quantized_attention_stays_close_to_float).
AMX_ATOL = 3e-4


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


@pytest.mark.parametrize("loops", ["amx", "simd", "portable"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_matches_dequantized_reference(kind, shape, window, loops):
    """Decodes at several depths, a prefill, a prefill chunk after a prefix; GQA, MHA, MQA; windows;
    the AVX-512 loops (where built: every shape here has head_dim % 16 == 0), the portable ones, and
    AMX tiles where usable (int8, SmolLM2's shape, tiles of several tokens: the query and p carry ~16
    bits there, test_paged_attention_amx.py)."""
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(0), shape, SEQS)
    kq, vq, quant, kd, vd = quantize_pool(kind, k, v, shape.num_kv_heads)
    got = paged_attention(q, kq, vq, tables, seqs, pos, shape, window=window, quant=quant,
                          simd=loops != "portable", amx=loops == "amx")  # fmt: skip
    want = reference(q, kd, vd, tables, seqs, pos, shape, window=window)
    np.testing.assert_allclose(got, want, atol=AMX_ATOL if loops == "amx" else 3e-5)


@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
def test_simd_and_portable_loops_agree(kind):
    """The two implementations differ only in summation order: float32 rounding, not a formula."""
    shape = SHAPES[0]
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(7), shape, [(130, 1), (0, 37), (70, 5), (3, 1)])
    kq, vq, quant = (k, v, None) if kind is None else quantize_pool(kind, k, v, shape.num_kv_heads)[:3]
    fast = paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=quant, amx=False)
    np.testing.assert_allclose(fast, paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=quant, simd=False),
                               atol=2e-6)  # fmt: skip


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_every_code_decodes_exactly_in_the_kernel(kind, simd):
    """A query attending to one key gets that key's value row exactly (p = 1): with every int8 code
    (-127..127) or every finite fp8 code (subnormals, +-0, +-448) in the row, the kernel's
    decoding is checked code by code against the reference decoder."""
    shape = AttentionShape(num_heads=4, num_kv_heads=4, head_dim=64, block_size=8)  # 256 values per row
    codes = np.arange(256, dtype=np.uint8)
    if kind == "int8":
        row = np.clip(codes.astype(np.int16) - 128, -127, 127).astype(np.int8)
        row_scales = np.array([0.5, 0.25, 2.0, 1e-3], np.float32)
        want = dequantize_int8(row[None], row_scales[None])[0]
        pool = np.zeros((2, 8, 256), np.int8)
        scales = np.ones((2, 8, 4), np.float32)
        scales[0, 0] = row_scales
        quant = KVQuant("int8", scales, scales)
    else:
        row = np.where(np.isin(codes, [0x7F, 0xFF]), 0, codes).astype(np.uint8)  # the two NaNs are never stored
        want = decode_fp8(row, 0.75)
        pool, quant = np.zeros((2, 8, 256), np.uint8), KVQuant("fp8", k_scale=1.0, v_scale=0.75)
    pool[0, 0] = row
    q = np.random.default_rng(8).standard_normal((1, 256), dtype=np.float32)
    tables, first = np.array([[0]], np.int64), np.zeros(1, np.int64)
    got = paged_attention(q, pool, pool, tables, first, first, shape, quant=quant, simd=simd)
    np.testing.assert_array_equal(got[0], want)


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


def pool_config(kind: str, layers: int = 2) -> EngineConfig:
    """A small engine config (3 kv heads of 64, blocks of 16) with a pool in KV dtype `kind`."""
    spec = ModelSpec("llama", 256, 576, 1536, layers, 9, 3, 64, 1e-5, True, False, "default", 512,
                     (None,) * layers, 1, (2,))  # fmt: skip
    config = EngineConfig(Path("."), "onnxruntime-cpu", "float32", 16, 4, 512, spec)
    scales = tuple((0.02 * (i + 1), 0.03 * (i + 1)) for i in range(layers)) if kind == "fp8" else None
    return dataclasses.replace(config, kv_cache_dtype=kind, kv_scales=scales)


def awkward_rows(rng: np.random.Generator, tokens: int, width: int, head_dim: int) -> np.ndarray:
    """Rows that exercise the codecs' edges: ties of the int8 rounding (x * 127 / absmax exactly
    k + 0.5), an all-zero head, -0.0, fp8 saturation (|x| / scale > 448), fp8 subnormals and values
    that round across a binade."""
    rows = rng.standard_normal((tokens, width)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], (tokens, 1))
    rows[0, :head_dim] = 0.0
    rows[0, head_dim] = -0.0
    rows[1, head_dim : 2 * head_dim] = (np.arange(head_dim) - 32 + 0.5).astype(np.float32)  # absmax 32: ties
    rows[1, head_dim] = 127.0  # absmax 127: x * 127 / 127 = x, half-integers tie
    rows[2, :8] = [1e6, -1e6, 448 * 0.02, 2.0**-9 * 0.02, 2.0**-10 * 0.02, 3 * 2.0**-10 * 0.02, 0.0296, -1e-30]
    return rows


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_c_write_matches_the_numpy_write_bit_for_bit(kind):
    """KVPool.write (one C call per layer) against KVPool.write_numpy (kv_quant's codecs): the same
    codes and scales, byte for byte, including round-half-even ties, zero rows and saturation."""
    config = pool_config(kind)
    fast, slow = KVPool.allocate(config, 8), KVPool.allocate(config, 8)
    rng = np.random.default_rng(9)
    for layer, tokens in ((0, 40), (1, 7), (0, 3)):  # a prefill, decodes, a rewrite of used slots
        k = awkward_rows(rng, tokens, config.model.kv_width, config.model.head_dim)
        v = awkward_rows(rng, tokens, config.model.kv_width, config.model.head_dim)[::-1].copy()
        slots = rng.choice(8 * 16, tokens, replace=False).astype(np.int64)
        fast.write(layer, slots, k, v)
        slow.write_numpy(layer, slots, k, v)
        assert fast.data.tobytes() == slow.data.tobytes()
        if kind == "int8":
            assert fast.scales is not None and slow.scales is not None
            assert fast.scales.tobytes() == slow.scales.tobytes()


def test_the_write_comparison_catches_a_wrong_scale():
    """The bit-for-bit check can fail: scaling one head's values by 2 leaves its int8 codes unchanged,
    so only the scale pool shows it; fp8 codes move with a layer scale 5% off."""
    config = pool_config("int8")
    good, bad = KVPool.allocate(config, 8), KVPool.allocate(config, 8)
    rows = np.random.default_rng(10).standard_normal((4, config.model.kv_width)).astype(np.float32)
    slots = np.arange(4, dtype=np.int64)
    doubled = rows.copy()
    doubled[2, 64:128] *= 2
    good.write(0, slots, rows, rows)
    bad.write_numpy(0, slots, doubled, rows)
    assert good.data.tobytes() == bad.data.tobytes()
    assert good.scales is not None and bad.scales is not None
    assert good.scales.tobytes() != bad.scales.tobytes()
    fp8 = pool_config("fp8")
    a, b = KVPool.allocate(fp8, 8), KVPool.allocate(fp8, 8)
    a.write(0, slots, rows, rows)
    b_config = dataclasses.replace(fp8, kv_scales=((0.021, 0.03), (0.04, 0.06)))
    KVPool(b_config, b.data, None).write(0, slots, rows, rows)
    assert a.data.tobytes() != b.data.tobytes()


def test_write_refuses_slots_outside_the_pool():
    config = pool_config("int8")
    pool = KVPool.allocate(config, 2)
    rows = np.ones((2, config.model.kv_width), np.float32)
    before = pool.data.copy()
    with pytest.raises(IndexError, match="slot 32 outside the pool"):
        pool.write(0, np.array([0, 32], np.int64), rows, rows)
    np.testing.assert_array_equal(pool.data, before)  # checked before anything is written
    k_rows = pool_rows(pool.data)[0]
    with pytest.raises(ValueError, match="int8 scales must be"):
        write_kv(rows, rows, np.array([0, 1], np.int64), k_rows, k_rows, KVQuant("int8"))

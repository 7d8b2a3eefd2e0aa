"""The kernel's AMX tiles (executors/kernels/attention_amx.h): int8 pools, tiles of several
tokens (verify rows, prefill). The query and p x value scale are split into two int8 parts each
(~16 bits), so the tiles match the dequantized float64 reference to AMX_ATOL, not float32 rounding;
the integer products are exact, so a row's numbers do not depend on its tile mates or the threads."""

from __future__ import annotations

import numpy as np
import pytest

from executors.cpu_attention import AttentionShape, amx_available, paged_attention
from executors.kv_quant import KVQuant
from tests.test_kv_quant_kernel import AMX_ATOL, quantize_pool
from tests.test_paged_attention import make_case, reference

# Verify tiles (4 tokens), prefill from scratch and after a prefix, unaligned starts, partial chunks,
# a lone decode (vector loops) among them.
SEQS = [(130, 4), (0, 37), (70, 5), (3, 2), (15, 17), (200, 1), (47, 3)]

needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX-INT8 here: int8 tiles run on the vector loops")


def smollm2_case(block_size: int, seed: int = 0):
    shape = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size)
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(seed), shape, SEQS, num_blocks=4096 // block_size)
    kq, vq, quant, kd, vd = quantize_pool("int8", k, v, shape.num_kv_heads)
    return shape, q, kq, vq, quant, kd, vd, tables, seqs, pos


@needs_amx
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_amx_tiles_match_the_reference_and_the_vector_loops(block_size, window):
    shape, q, kq, vq, quant, kd, vd, tables, seqs, pos = smollm2_case(block_size)
    amx = paged_attention(q, kq, vq, tables, seqs, pos, shape, window=window, quant=quant)
    vector = paged_attention(q, kq, vq, tables, seqs, pos, shape, window=window, quant=quant, amx=False)
    want = reference(q, kd, vd, tables, seqs, pos, shape, window=window)
    np.testing.assert_allclose(amx, want, atol=AMX_ATOL)
    np.testing.assert_allclose(vector, want, atol=3e-5)
    lone = seqs == 5  # the (200, 1) decode: vector loops either way
    np.testing.assert_array_equal(amx[lone], vector[lone])
    assert np.abs(amx[~lone] - vector[~lone]).max() > 0  # the tiles did run on AMX


@needs_amx
def test_a_row_does_not_depend_on_its_tile_mates_or_the_threads():
    """Positions 132-133 of the (130, 4) verify tile, computed again as a 2-token tile of their own:
    bit for bit the same, on one thread or two."""
    shape, q, kq, vq, quant, _, _, tables, seqs, pos = smollm2_case(16)
    full = paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=quant, threads=2)
    pair = slice(2, 4)  # tokens 2, 3 of sequence 0
    alone = paged_attention(q[pair], kq, vq, tables[:1], seqs[pair], pos[pair], shape, quant=quant, threads=1)
    np.testing.assert_array_equal(alone, full[pair])


@needs_amx
def test_a_corrupted_value_scale_is_caught_on_amx():
    """The comparison above can fail on the AMX path: doubling one key's value scale in a verify tile's
    context moves its rows beyond the tolerance."""
    shape, q, kq, vq, quant, kd, vd, tables, seqs, pos = smollm2_case(16)
    want = reference(q, kd, vd, tables, seqs, pos, shape)
    v_scales = quant.v_scales.copy()
    v_scales[tables[0, 8], 3] *= 2.0  # sequence 0's key 131 (block 8, offset 3), every kv head
    broken = KVQuant("int8", quant.k_scales, v_scales)
    got = paged_attention(q, kq, vq, tables, seqs, pos, shape, quant=broken)
    assert np.abs(got[seqs == 0] - want[seqs == 0]).max() > 10 * AMX_ATOL

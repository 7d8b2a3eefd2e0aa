"""The ragged decode and FlashAttention-2 prefill kernels (plugins_cuda/decode_attention.py,
prefill_attention.py) at the tiles the GPU runs (128-row query tiles, 64/128-key tiles) and at
the float32 verification tiles, under Triton's interpreter against the float64 numpy
reference; the key-range split (masked edges, unmasked middle) against brute force; the
decode split plan (one launch when a split does not pay)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
from plugins_cuda.interpreter import interpreter_problem  # noqa: E402

if interpreter_problem():
    pytest.skip(interpreter_problem(), allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from executors.cpu_attention import AttentionShape  # noqa: E402
from plugins_cuda import decode_attention  # noqa: E402
from plugins_cuda.attention_core import key_ranges  # noqa: E402
from plugins_cuda.attention_launch import launch_ragged, ragged_layout  # noqa: E402
from plugins_cuda.decode_attention import DecodeTiles, launch_decode, plan_splits  # noqa: E402
from plugins_cuda.prefill_attention import PrefillTiles, launch_prefill  # noqa: E402
from tests.test_paged_attention import make_case, reference  # noqa: E402

GPU_PREFILL = PrefillTiles(128, 64, 8, 3)  # what a bf16 head_dim-128 launch compiles on sm_90


def tensors(args, dtype=torch.float32):
    q, k, v, tables, seqs, pos = args
    query_start, max_rows = ragged_layout(torch.from_numpy(seqs))
    floats = [torch.from_numpy(x).to(dtype) for x in (q, k, v)]
    return (*floats, torch.from_numpy(tables), torch.from_numpy(pos), query_start), max_rows


def prefill(args, shape, tiles, window=0, dtype=torch.float32):
    (q, k, v, tables, pos, query_start), max_rows = tensors(args, dtype)
    out = torch.zeros_like(q)
    group = shape.num_heads // shape.num_kv_heads
    launch_prefill(q, k, v, tables, pos, query_start, max_rows, shape.num_kv_heads, group, shape.head_dim, tiles,
                   shape.block_size, shape.head_dim**-0.5, window, out)  # fmt: skip
    return out.float().numpy()


def decode(args, shape, tiles, sm_count, window=0):
    (q, k, v, tables, pos, query_start), _ = tensors(args)
    out = torch.zeros_like(q)
    splits = launch_decode(q, k, v, tables, pos, query_start, shape.num_kv_heads, tiles, shape.block_size,
                           shape.head_dim**-0.5, window, sm_count, out)  # fmt: skip
    return out.numpy(), splits


PREFILL_CASES = [
    # (shape, seqs, window): a 128-row tile holds 32 tokens of a group of 4
    (AttentionShape(8, 2, 32, 16), [(0, 70), (150, 40)], 0),  # block 16 < 64-key tile: gathered rows
    (AttentionShape(8, 2, 32, 64), [(0, 100), (200, 33)], 0),  # block 64 == tile: one table entry a tile
    (AttentionShape(8, 2, 32, 128), [(37, 90)], 50),  # window edge tiles, block of two tiles
    (AttentionShape(6, 2, 32, 8), [(300, 45), (0, 3)], 0),  # group 3: 42 tokens a tile, 2 idle rows
]


@pytest.mark.parametrize(("shape", "seqs", "window"), PREFILL_CASES, ids=range(len(PREFILL_CASES)))
def test_prefill_gpu_tiles_match_reference(shape, seqs, window):
    args = make_case(np.random.default_rng(0), shape, seqs, num_blocks=256 * 16 // shape.block_size)
    want = reference(*args, shape, window=window or None)
    np.testing.assert_allclose(prefill(args, shape, GPU_PREFILL, window), want, atol=2e-5)


def test_prefill_float16_tiles_and_verification_tiles():
    shape = AttentionShape(8, 2, 64, 16)
    args = make_case(np.random.default_rng(1), shape, [(20, 150), (0, 9)], num_blocks=64)
    want = reference(*args, shape)
    f16 = PrefillTiles.for_shape(4, 64, 2)
    assert (f16.block_m, f16.block_n, f16.num_warps, f16.num_stages) == (128, 128, 8, 3)
    np.testing.assert_allclose(prefill(args, shape, f16, dtype=torch.float16), want, atol=2e-2)
    np.testing.assert_allclose(prefill(args, shape, PrefillTiles.for_shape(4, 64, 4)), want, atol=2e-5)


def test_prefill_reads_the_unmasked_middle_tiles():
    """A key that every row sees whole (far below the diagonal) must move the output: the
    unmasked loop is not skipped; and a position off by one is caught."""
    shape = AttentionShape(4, 1, 32, 16)
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(2), shape, [(256, 64)], num_blocks=64)
    want = reference(q, k, v, tables, seqs, pos, shape)
    broken = k.copy()
    broken[tables[0, 2], 5] *= 40.0  # key 37: inside tile 0 of 64 keys, unmasked for every row
    got = prefill((q, broken, v, tables, seqs, pos), shape, GPU_PREFILL)
    assert np.abs(got - want).max() > 1e-2
    np.testing.assert_allclose(got, reference(q, broken, v, tables, seqs, pos, shape), atol=2e-5)
    assert np.abs(prefill((q, k, v, tables, seqs, pos - 1), shape, GPU_PREFILL) - want).max() > 1e-2


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_splits_and_single_launch_match_reference(block_size):
    shape = AttentionShape(8, 2, 32, block_size)
    seqs = [(1500, 1), (3, 1), (700, 1)]
    args = make_case(np.random.default_rng(3), shape, seqs, num_blocks=4096 // block_size)
    want = reference(*args, shape)
    tiles = DecodeTiles(4, 32, 2)  # the 16-bit tiles (128-key tiles at head_dim 32) over fp32 data
    split, n = decode(args, shape, tiles, sm_count=4)  # 16 programs wanted, 6 lanes
    assert n == plan_splits(3, args[3].shape[1] * block_size, 2, 4) > 1
    single, one = decode(args, shape, tiles, sm_count=1)  # 6 lanes >= 4 programs wanted
    assert one == 1
    np.testing.assert_allclose(split, want, atol=2e-5)
    np.testing.assert_allclose(single, want, atol=2e-5)
    window = reference(*args, shape, window=600)
    np.testing.assert_allclose(decode(args, shape, tiles, 4, window=600)[0], window, atol=2e-5)


def test_decode_one_launch_without_workspace_when_a_split_does_not_pay(monkeypatch):
    shape = AttentionShape(8, 2, 32, 16)
    args = make_case(np.random.default_rng(4), shape, [(300, 1), (40, 1)], num_blocks=64)
    monkeypatch.setattr(decode_attention, "split_workspace", lambda *a: pytest.fail("no workspace for 1 split"))
    out, splits = decode(args, shape, DecodeTiles(4, 32, 4), sm_count=132)
    assert splits == 1  # 304 keys < 2 parts of 256
    np.testing.assert_allclose(out, reference(*args, shape), atol=2e-5)


def test_split_plan():
    assert plan_splits(1, 255, 8, 132) == 1  # batch 1, under 512 keys: one launch, no merge
    assert plan_splits(1, 512, 8, 132) == 2  # 256 keys a part
    assert plan_splits(1, 4096, 8, 132) == 16
    assert plan_splits(1, 32768, 8, 132) == 64  # the cap
    assert plan_splits(8, 4096, 8, 132) == 9  # 64 lanes: ceil(528 / 64) = 9, context allows 16
    assert plan_splits(32, 32768, 8, 132) == 3  # 256 lanes: ceil(528 / 256)
    assert plan_splits(128, 4096, 8, 132) == 1  # 1024 lanes fill the GPU
    assert plan_splits(1, 2**20, 8, 16) == 8  # a small GPU wants fewer programs


def test_launch_ragged_dispatches_by_rows_per_sequence():
    shape = AttentionShape(8, 2, 32, 16)
    for seqs in ([(40, 4), (9, 1)], [(40, 5), (9, 1)]):  # 4 rows: decode tile of 16; 5: prefill
        q, k, v, tables, seq_of_token, pos = make_case(np.random.default_rng(5), shape, seqs, num_blocks=64)
        query_start, max_rows = ragged_layout(torch.from_numpy(seq_of_token))
        got = launch_ragged(*(torch.from_numpy(x) for x in (q, k, v, tables, pos)), query_start, max_rows, 2,
                            sm_count=132)  # fmt: skip
        np.testing.assert_allclose(got.numpy(), reference(q, k, v, tables, seq_of_token, pos, shape), atol=2e-5)


# ---- key ranges ----------------------------------------------------------------------------------


@triton.jit
def _ranges_probe(pos_ptr, out_ptr, n, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, M: tl.constexpr):
    r = tl.arange(0, M)
    real = r < n
    pos = tl.load(pos_ptr + r, mask=real, other=-1)
    first, full_lo, full_hi, end = key_ranges(pos, real, WINDOW, BLOCK_N)
    tl.store(out_ptr + 0, first)
    tl.store(out_ptr + 1, full_lo)
    tl.store(out_ptr + 2, full_hi)
    tl.store(out_ptr + 3, end)


def brute_ranges(pos: list[int], window: int, block_n: int) -> tuple[set[int], set[int]]:
    """(tiles some row sees a key of, tiles every row sees whole)."""
    tiles = range(max(pos) // block_n + 1) if pos else range(0)
    seen, whole = set(), set()
    for j in tiles:
        keys = range(j * block_n, (j + 1) * block_n)
        vis = [[k <= p and (not window or k > p - window) for k in keys] for p in pos]
        seen |= {j} if any(map(any, vis)) else set()
        whole |= {j} if all(map(all, vis)) else set()
    return seen, whole


def test_key_ranges_against_brute_force():
    rng = np.random.default_rng(6)
    for _ in range(60):
        n, start = int(rng.integers(0, 9)), int(rng.integers(0, 300))
        window, block_n = int(rng.choice([0, 1, 5, 40, 100])), int(rng.choice([16, 32]))
        pos = list(range(start, start + n))
        out = torch.zeros(4, dtype=torch.int32)
        _ranges_probe[(1,)](torch.tensor(pos + [0] * (16 - n), dtype=torch.int64), out, n, WINDOW=window,
                            BLOCK_N=block_n, M=16)  # fmt: skip
        first, full_lo, full_hi, end = out.tolist()
        seen, whole = brute_ranges(pos, window, block_n)
        assert first <= full_lo <= full_hi <= end, (pos, window, out)
        assert seen <= set(range(first, end)), (pos, window, out)  # no visible tile is skipped
        assert set(range(full_lo, full_hi)) <= whole, (pos, window, out)  # unmasked tiles are whole
        assert whole == set(range(full_lo, full_hi)), (pos, window, out)  # and only the edges are masked

"""The key loop shared by the ragged decode and prefill attention kernels (decode_attention.py,
prefill_attention.py): FlashAttention-2's online softmax over the paged pool.

Why it is shaped this way:
- A tile's keys [first, end) (in BLOCK_N tiles) fall in three ranges: tiles some row must not
  see part of (the causal diagonal, the sliding window's lower edge) and, between them, tiles
  every real row sees whole. `key_ranges` computes the ranges once per program; the whole
  tiles run a loop with no mask at all (no key bound, no causal compare, no -inf guard) and
  only the edge tiles pay for masking, as FlashAttention's causal kernels do. Tiles past the
  tile's last position are never visited: causal tiles are skipped, not masked.
- Softmax in base 2 with the scale folded into log2(e): scores * (SCALE * LOG2E) is one FMA
  feeding exp2, the native instruction, and normalization is deferred to the end (acc / l).
- A K/V tile is gathered through the block table. When a pool block holds whole tiles
  (BLOCK_SIZE % BLOCK_N == 0) the tile is one block: one scalar table load and contiguous
  rows; otherwise each key row has its own block (block size 16 with 64-key tiles).
- The loop bodies are plain loads + tl.dot: Triton software-pipelines them (num_stages) with
  cp.async on sm_80+, and on sm_90 lowers the dots to wgmma when the tile has >= 64 rows per
  warpgroup (checked in the AOT PTX, plugins_cuda/resources.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda.common import dot, row_offsets

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def key_ranges(pos, real, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key-tile bounds (first, full_lo, full_hi, end) of a tile of rows at positions `pos`
    (`real` marks the rows that exist): [first, full_lo) and [full_hi, end) need masks, every
    real row sees all of [full_lo, full_hi). No real row: all four are 0."""
    hi = tl.max(tl.where(real, pos, -1), axis=0)
    lo_pos = tl.min(tl.where(real, pos, hi), axis=0)
    any_real = hi >= 0
    first = 0
    win_lo = 0
    if WINDOW > 0:
        first = tl.maximum(lo_pos - WINDOW + 1, 0) // BLOCK_N
        win_lo = tl.cdiv(tl.maximum(hi - WINDOW + 1, 0), BLOCK_N)  # keys >= hi - W + 1 are in every window
    first = tl.where(any_real, first, 0)
    end = tl.where(any_real, tl.maximum(hi, 0) // BLOCK_N + 1, 0)
    full_lo = tl.minimum(tl.maximum(first, win_lo), end)
    full_hi = tl.maximum(full_lo, tl.minimum((lo_pos + 1) // BLOCK_N, end))  # keys <= lo_pos: every row sees
    return first, full_lo, full_hi, end


@triton.jit
def _kv_offsets(table, tile, kv_head, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_ROW: tl.constexpr,
                HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """(keys [BLOCK_N], element offsets of their K/V rows for kv_head) of key tile `tile`."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one pool block: one table entry, contiguous rows
        block = tl.load(table + (tile * BLOCK_N) // BLOCK_SIZE).to(tl.int64)
        slots = block * BLOCK_SIZE + (tile * BLOCK_N) % BLOCK_SIZE + tl.arange(0, BLOCK_N)
    else:
        if MASKED:
            blocks = tl.load(table + keys // BLOCK_SIZE, mask=keys <= hi, other=0)
        else:
            blocks = tl.load(table + keys // BLOCK_SIZE)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    return keys, slots * KV_ROW + kv_head * HEAD_DIM


@triton.jit
def attend_range(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, pos, hi, start, stop,
                 SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Key tiles [start, stop) folded into (acc, m_i, l_i); m_i in log2 units. MASKED: some row
    must not see some key of these tiles (causal edge, window edge, keys past `hi`)."""
    KV_ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    QK_SCALE: tl.constexpr = SCALE * LOG2E
    dims = tl.arange(0, HEAD_DIM)
    for tile in range(start, stop):
        keys, kv = _kv_offsets(table, tile, kv_head, hi, BLOCK_N, BLOCK_SIZE, KV_ROW, HEAD_DIM, MASKED)
        if MASKED:
            key_ok = keys <= hi
            k = tl.load(k_cache_ptr + kv[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
            visible = keys[None, :] <= pos[:, None]
            if WINDOW > 0:
                visible = visible & (keys[None, :] > pos[:, None] - WINDOW)
            qk = tl.where(visible, dot(q, tl.trans(k)) * QK_SCALE, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet stays 0
            p = tl.exp2(qk - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
        else:
            k = tl.load(k_cache_ptr + kv[:, None] + dims[None, :])
            v = tl.load(v_cache_ptr + kv[:, None] + dims[None, :])
            qk = dot(q, tl.trans(k))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * QK_SCALE)
            p = tl.exp2(qk * QK_SCALE - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def attend_rows(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, positions_ptr, seq, row0, n_real, t0, split, splits,
                table_width, SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """Tokens t0 .. t0 + BLOCK_M // GROUP - 1 of sequence `seq` (rows row0 + t of q) x the GROUP
    query heads of kv head program_id(1) (row r: token r // GROUP, head r % GROUP), over part
    `split` of `splits` of their keys. Returns (acc, m_i, l_i, q_rows, real): unnormalized."""
    kv_head = tl.program_id(1)
    Q_ROW: tl.constexpr = NUM_KV_HEADS * GROUP * HEAD_DIM
    r = tl.arange(0, BLOCK_M)
    t = t0 + r // GROUP
    real = (r < (BLOCK_M // GROUP) * GROUP) & (t < n_real)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = row_offsets(row0 + t, Q_ROW) + (kv_head * GROUP + r % GROUP) * HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=real[:, None], other=0.0)
    pos = tl.load(positions_ptr + row0 + t, mask=real, other=-1).to(tl.int32)

    first, full_lo, full_hi, end = key_ranges(pos, real, WINDOW, BLOCK_N)
    per_split = tl.cdiv(end - first, splits)
    lo = first + split * per_split
    hi_tile = tl.minimum(end, lo + per_split)
    hi = tl.max(pos, axis=0)
    table = tables_ptr + row_offsets(seq, table_width)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m_i, l_i = attend_range(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, pos, hi,
                                 lo, tl.minimum(hi_tile, full_lo), SCALE, WINDOW, NUM_KV_HEADS, HEAD_DIM,
                                 BLOCK_SIZE, BLOCK_N, True)  # fmt: skip
    acc, m_i, l_i = attend_range(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, pos, hi,
                                 tl.maximum(lo, full_lo), tl.minimum(hi_tile, full_hi), SCALE, WINDOW,
                                 NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False)  # fmt: skip
    acc, m_i, l_i = attend_range(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, pos, hi,
                                 tl.maximum(lo, full_hi), hi_tile, SCALE, WINDOW, NUM_KV_HEADS, HEAD_DIM,
                                 BLOCK_SIZE, BLOCK_N, True)  # fmt: skip
    return acc, m_i, l_i, q_rows, real

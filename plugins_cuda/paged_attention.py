"""Paged attention as Triton-language GPU kernels (the TensorRT plugins' implementation).

Contract as the CPU kernel and engine_format/INTERFACE.md: each query token of a sequence
attends to its sequence's keys at positions [max(0, pos - window + 1), pos], read in place
from the paged pool through the block table. Queries come in the plugin graph's padded
[batch, step] layout (a sequence's real row count is read off its positions: they run
past_len, past_len + 1, ... and padding repeats the last one). No attention is computed for
padding rows; they get zeros. The torch API's flat ragged layout has kernels of its own
(decode_attention.py, prefill_attention.py: FlashAttention-2 tiles, one launch when a split
does not pay); they share this file's split-part layout and its ragged merge kernel.

Grid (work, kv heads, sequences). A program's M tile packs query tokens x the GROUP query
heads sharing its kv head (row r = token r // GROUP, head r % GROUP), so one K/V tile feeds
every head of the group and every token of the tile. Two paths, chosen per launch by `step`
(rows per sequence):
- decode (step <= DECODE_M // GROUP: decodes, short speculative verifies): one DECODE_M-row
  tile per sequence; the key range is cut into `splits` contiguous parts, one per program
  (work = split). With splits > 1 each part writes (o, lse) to `partials` and the merge
  kernel combines them; with 1 split the program writes the output itself.
- prefill (longer steps, chunked prefill): PREFILL_M-row tiles of PREFILL_M // GROUP
  consecutive tokens (work = tile, last tile first: causal tiles grow with the index), over
  the keys up to the tile's last position with a per-row causal/window mask.
Keys are walked BLOCK_N at a time whatever the block size (a tile may span pool blocks).
The launcher's choice of `splits` lives in plugins_cuda/attention_launch.py.

Verified here only under TRITON_INTERPRET=1 (CPU) and by AOT compilation for sm_80/89/90;
nothing in this file has run on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda.common import dot, row_offsets, slot_offsets, step_kernel
from plugins_cuda.kv_codec import dequantize

LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp2 is the native instruction


@triton.jit
def _attend(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, positions_ptr, out_ptr, partials_ptr, k_scales_ptr, v_scales_ptr,
    seq, row0, n_real, owned, t0, split, splits, slot, table_width,
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,
):  # fmt: skip
    """Tokens t0 .. t0 + BLOCK_M // GROUP - 1 of sequence `seq` (q/out rows row0 + t) x the
    query heads of kv head program_id(1), over part `split` of `splits` of the tile's keys.
    Tokens t < n_real are real; t < owned are the sequence's rows in `out`. KV_QUANT (kv_codec.py):
    0 a float pool; 1 int8 codes with scale pools k/v_scales_ptr; 2 fp8 with the scalars at k/v_scales_ptr."""
    kv_head = tl.program_id(1)
    k_scale = 1.0
    v_scale = 1.0
    if KV_QUANT == 2:
        k_scale = tl.load(k_scales_ptr)
        v_scale = tl.load(v_scales_ptr)
    Q_ROW: tl.constexpr = NUM_KV_HEADS * GROUP * HEAD_DIM
    KV_ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    r = tl.arange(0, BLOCK_M)
    t = t0 + r // GROUP
    in_tile = r < (BLOCK_M // GROUP) * GROUP
    real = in_tile & (t < n_real)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = row_offsets(row0 + t, Q_ROW) + (kv_head * GROUP + r % GROUP) * HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=real[:, None], other=0.0)
    pos = tl.load(positions_ptr + row0 + t, mask=real, other=-1).to(tl.int32)

    # The tile's keys [lo, hi], in BLOCK_N tiles, this program's share of them.
    hi = tl.max(pos, axis=0)  # -1: no real row, nothing to attend
    lo = tl.maximum(tl.min(tl.where(real, pos, hi), axis=0) - WINDOW + 1, 0) if WINDOW > 0 else 0
    first = lo // BLOCK_N
    n_tiles = tl.where(hi >= 0, hi // BLOCK_N + 1 - first, 0)
    per_split = tl.cdiv(n_tiles, splits)
    start = first + split * per_split
    end = tl.minimum(first + n_tiles, start + per_split)

    table = tables_ptr + row_offsets(seq, table_width)
    keys0 = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for key_tile in range(start, end):
        keys = key_tile * BLOCK_N + keys0
        key_ok = keys <= hi
        blocks = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        kv = slot_offsets(blocks, keys % BLOCK_SIZE, BLOCK_SIZE, KV_ROW) + kv_head * HEAD_DIM
        k = tl.load(k_cache_ptr + kv[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        scale_rows = slot_offsets(blocks, keys % BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS) + kv_head  # int8 only
        k = dequantize(k, k_scales_ptr, scale_rows, k_scale, key_ok, KV_QUANT).to(q.dtype)
        scores = dot(q, tl.trans(k)) * (SCALE * LOG2E)
        visible = keys[None, :] <= pos[:, None]
        if WINDOW > 0:
            visible = visible & (keys[None, :] > pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet stay 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = dequantize(v, v_scales_ptr, scale_rows, v_scale, key_ok, KV_QUANT).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
        m_i = m_new

    done = l_i > 0
    o = acc / tl.where(done, l_i, 1.0)[:, None]
    if splits == 1:
        keep = in_tile & (t < owned)
        tl.store(out_ptr + q_rows[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty), mask=keep[:, None])
    else:
        part = partials_ptr + row_offsets(slot, BLOCK_M * (HEAD_DIM + 1))
        tl.store(part + r[:, None] * HEAD_DIM + dims[None, :], o)
        lse = tl.where(done, m_i + tl.log2(tl.where(done, l_i, 1.0)), float("-inf"))  # log2 units, as m_i
        tl.store(part + BLOCK_M * HEAD_DIM + r, lse)


@triton.jit
def _dispatch(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, positions_ptr, out_ptr, partials_ptr, k_scales_ptr, v_scales_ptr,
    seq, row0, n_real, owned, step, splits, table_width,
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE_M: tl.constexpr, PREFILL_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    work = tl.program_id(0)
    if step <= DECODE_M // GROUP:
        slot = (seq * NUM_KV_HEADS + tl.program_id(1)) * splits + work
        _attend(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, positions_ptr, out_ptr, partials_ptr, k_scales_ptr,
                v_scales_ptr, seq, row0, n_real, owned, 0, work, splits, slot, table_width,
                SCALE, WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, DECODE_M, BLOCK_N, KV_QUANT)  # fmt: skip
    else:
        rows: tl.constexpr = PREFILL_M // GROUP
        t0 = (tl.cdiv(step, rows) - 1 - work) * rows
        _attend(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, positions_ptr, out_ptr, partials_ptr, k_scales_ptr,
                v_scales_ptr, seq, row0, n_real, owned, t0, 0, 1, 0, table_width,
                SCALE, WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, PREFILL_M, BLOCK_N, KV_QUANT)  # fmt: skip


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [B, S, Hq*D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv*D], this step's rows already written (PagedKVWrite)
    v_cache_ptr,
    block_tables_ptr,  # [B, table_width] int64
    positions_ptr,  # [B, S] int64
    step, table_width, splits,
    out_ptr,  # [B, S, Hq*D]
    partials_ptr,  # float32 workspace: splits x DECODE_M x (D + 1) per (sequence, kv head)
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE_M: tl.constexpr, PREFILL_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`trtserve::PagedAttention`: the padded layout, TensorRT's AOT argument order (inputs,
    int32 scalars, outputs)."""
    seq = tl.program_id(2)
    row0 = seq.to(tl.int64) * step
    n_real = (tl.load(positions_ptr + row0 + step - 1) - tl.load(positions_ptr + row0) + 1).to(tl.int32)
    _dispatch(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr, out_ptr, partials_ptr,
              k_cache_ptr, v_cache_ptr, seq, row0, n_real, step, step, splits, table_width,
              SCALE, WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, DECODE_M, PREFILL_M, BLOCK_N, 0)  # fmt: skip


@triton.jit
def _merge(
    partials_ptr, out_ptr, seq, row0, owned, splits,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DECODE_M: tl.constexpr,
):  # fmt: skip
    """Combine the `splits` parts of (sequence, kv head program_id(1)): softmax-weighted by each
    part's log-sum-exp. Rows no part saw (padding) come out 0."""
    kv_head = tl.program_id(1)
    r = tl.arange(0, DECODE_M)
    t = r // GROUP
    dims = tl.arange(0, HEAD_DIM)
    slot0 = (seq * NUM_KV_HEADS + kv_head) * splits
    m = tl.full([DECODE_M], float("-inf"), tl.float32)
    total = tl.zeros([DECODE_M], tl.float32)
    acc = tl.zeros([DECODE_M, HEAD_DIM], tl.float32)
    for part in range(splits):
        base = partials_ptr + row_offsets(slot0 + part, DECODE_M * (HEAD_DIM + 1))
        lse = tl.load(base + DECODE_M * HEAD_DIM + r)
        o = tl.load(base + r[:, None] * HEAD_DIM + dims[None, :])
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        weight = tl.exp2(lse - m_use)
        acc = acc * alpha[:, None] + weight[:, None] * o
        total = total * alpha + weight
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    q_rows = row_offsets(row0 + t, NUM_KV_HEADS * GROUP * HEAD_DIM) + (kv_head * GROUP + r % GROUP) * HEAD_DIM
    keep = (r < (DECODE_M // GROUP) * GROUP) & (t < owned)
    tl.store(out_ptr + q_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=keep[:, None])


@triton.jit
def paged_attention_merge_kernel(
    ctx_ptr,  # [B, S, Hq*D]: PagedAttention's output; the same memory as out_ptr (aliased), unused
    partials_ptr,
    block_tables_ptr,  # unused: an input for its shape (the launcher's `splits` depends on it)
    positions_ptr,  # unused: likewise (batch, step)
    step, splits,
    out_ptr,  # [B, S, Hq*D], written in place for split launches only
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DECODE_M: tl.constexpr,
):  # fmt: skip
    """`trtserve::PagedAttentionMerge`: grid (1, kv heads, sequences); nothing to do unless the
    attention launch was a split decode."""
    if (step <= DECODE_M // GROUP) & (splits > 1):
        seq = tl.program_id(2)
        _merge(partials_ptr, out_ptr, seq, seq.to(tl.int64) * step, step, splits, NUM_KV_HEADS, GROUP, HEAD_DIM,
               DECODE_M)  # fmt: skip


@step_kernel
def paged_attention_ragged_merge_kernel(
    partials_ptr, query_start_ptr, max_rows, splits, out_ptr,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DECODE_M: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(2)
    row0 = tl.load(query_start_ptr + seq).to(tl.int64)
    n_real = (tl.load(query_start_ptr + seq + 1) - row0).to(tl.int32)
    _merge(partials_ptr, out_ptr, seq, row0, n_real, splits, NUM_KV_HEADS, GROUP, HEAD_DIM, DECODE_M)

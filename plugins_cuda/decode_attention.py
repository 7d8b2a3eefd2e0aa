"""Decode attention over the flat ragged layout (the torch backend's decode steps and short
speculative verifies): one BLOCK_M-row tile per (sequence, kv head) packing its tokens x the
GROUP query heads of the kv head, the keys optionally cut into `splits` parts.

Why these choices:
- One launch when a split does not pay: `plan_splits` splits only while the grid is short of
  PROGRAMS_PER_SM programs per SM *and* every part still reads >= MIN_SPLIT_KEYS keys; a
  1-split launch is compiled without the partials path (SPLIT=False), writes the output
  itself, allocates no workspace and launches no merge. Small batches of long contexts get
  the programs they need to fill the GPU; a large batch, or a short context, one launch.
- 4 warps: a decode tile has only 16 rows; 8 warps split its N dimension so thin that the
  softmax's row reductions go through shared memory twice a tile. The loop is memory bound:
  its depth is num_stages (3 where shared memory allows, 2 on sm_86/89's 99 KB).
- The split workspace is allocated per launch (`split_workspace`), never cached: inside a
  CUDA-graph capture it comes from the graph's private pool and lives as long as the graph,
  so no later launch at another shape can free or move memory a captured launch writes.

Verified under TRITON_INTERPRET=1 (CPU), by AOT compilation, and on an H100 (plugins_cuda.check,
graph_check, bench: benchmarks/results/gpu-h100-2026-11-26).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from plugins_cuda.attention_core import attend_rows
from plugins_cuda.common import row_offsets, step_kernel

MIN_DOT = 16
MAX_SPLITS = 64
# A part below this reads too little K/V to pay for its partial write and the merge. 256, not 512: on an H100
# (benchmarks/results/gpu-h100-2026-11-26) the old plugin launcher, which splits by 256 keys, beat this
# kernel at 512 keys a part where that gave it twice the splits: 10.7 vs 13.8 µs at batch 1 x 512 keys (2
# parts vs 1), 15.2 vs 19.6 at 1 x 4,096 (16 vs 8). Not yet re-timed with 256 here.
MIN_SPLIT_KEYS = 256
PROGRAMS_PER_SM = 4  # shared memory holds ~2 resident programs per SM; 2 waves hide the tail
SMALL_SMEM_ARCHS = (86, 87, 89, 120)  # 99-101 KB of shared memory per block


@dataclass(frozen=True)
class DecodeTiles:
    """Compile-time tiles of the decode kernel for one (group, head_dim, element size, arch)."""

    group: int
    head_dim: int
    element_bytes: int = 2
    arch: int = 90

    @property
    def block_m(self) -> int:  # the smallest tl.dot M holding a whole group
        return max(MIN_DOT, triton.next_power_of_2(self.group))

    @property
    def rows(self) -> int:  # tokens per sequence this path takes (1 + speculative drafts)
        return self.block_m // self.group

    @property
    def block_n(self) -> int:
        if self.element_bytes == 4:
            return 16  # fp32 multiplies on the FMA units, operands in registers
        return 64 if self.head_dim >= 128 else 128

    @property
    def num_warps(self) -> int:
        return 4

    @property
    def num_stages(self) -> int:
        return 2 if self.element_bytes == 4 or self.arch in SMALL_SMEM_ARCHS else 3

    @property
    def slot_width(self) -> int:  # floats per split part: o [BLOCK_M, D] then lse [BLOCK_M]
        return self.block_m * (self.head_dim + 1)


def plan_splits(batch: int, context: int, num_kv_heads: int, sm_count: int) -> int:
    """KV parts per (sequence, kv head); `context` is the longest key range of the launch."""
    lanes = batch * num_kv_heads
    target = PROGRAMS_PER_SM * sm_count
    if lanes >= target:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(target, lanes), context // MIN_SPLIT_KEYS))


def split_workspace(parts: int, width: int, device):
    """float32 [parts, width] for split partials; allocated per launch on purpose (module doc)."""
    import torch

    return torch.empty((parts, width), dtype=torch.float32, device=device)


@step_kernel
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr,  # q [T, Hq*D], positions [T]
    query_start_ptr,  # [B + 1] int32
    table_width, splits, out_ptr, partials_ptr,
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """Grid (splits, kv heads, sequences). SPLIT: write (o, lse) parts for the merge kernel
    (plugins_cuda/paged_attention.py's ragged merge, same slot layout); else the output."""
    seq = tl.program_id(2)
    row0 = tl.load(query_start_ptr + seq).to(tl.int64)
    n_real = (tl.load(query_start_ptr + seq + 1) - row0).to(tl.int32)
    split = tl.program_id(0)  # 0 of 1 unless SPLIT
    acc, m_i, l_i, q_rows, real = attend_rows(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr, seq, row0, n_real, 0, split, splits,
        table_width, SCALE, WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    done = l_i > 0
    o = acc / tl.where(done, l_i, 1.0)[:, None]
    dims = tl.arange(0, HEAD_DIM)
    if SPLIT:
        r = tl.arange(0, BLOCK_M)
        slot = (seq * NUM_KV_HEADS + tl.program_id(1)) * splits + split
        part = partials_ptr + row_offsets(slot, BLOCK_M * (HEAD_DIM + 1))
        tl.store(part + r[:, None] * HEAD_DIM + dims[None, :], o)
        tl.store(part + BLOCK_M * HEAD_DIM + r, tl.where(done, m_i + tl.log2(tl.where(done, l_i, 1.0)), float("-inf")))
    else:
        tl.store(out_ptr + q_rows[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty), mask=real[:, None])


def launch_decode(q, k_cache, v_cache, tables, positions, query_start, num_kv_heads: int, tiles: DecodeTiles,
                  block_size: int, scale: float, window: int, sm_count: int, out):  # fmt: skip
    """Decode launch (and the merge when split) into `out`; tables int64 [B, W], positions int64."""
    from plugins_cuda import paged_attention as kernels

    batch = query_start.shape[0] - 1
    splits = plan_splits(batch, tables.shape[1] * block_size, num_kv_heads, sm_count)
    partials = split_workspace(batch * num_kv_heads * splits, tiles.slot_width, q.device) if splits > 1 else out
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    paged_decode_kernel[(splits, num_kv_heads, batch)](
        q, k_cache, v_cache, tables, positions, query_start, tables.shape[1], splits, out, partials,
        SCALE=float(scale), WINDOW=int(window), NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group,
        HEAD_DIM=tiles.head_dim, BLOCK_SIZE=block_size, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        SPLIT=splits > 1, **launch,
    )  # fmt: skip
    if splits > 1:
        kernels.paged_attention_ragged_merge_kernel[(1, num_kv_heads, batch)](
            partials, query_start, 1, splits, out, NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group,
            HEAD_DIM=tiles.head_dim, DECODE_M=tiles.block_m, num_warps=tiles.num_warps,
        )  # fmt: skip
    return splits

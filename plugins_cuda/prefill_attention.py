"""Prefill attention over the flat ragged layout (prompt chunks, long speculative verifies):
FlashAttention-2's forward pass over the paged pool.

Grid (query tiles of the longest chunk, kv heads, sequences); a tile is BLOCK_M rows packing
BLOCK_M // GROUP consecutive tokens x the GROUP query heads of its kv head, so every K/V tile
loaded from the pool feeds all the heads that share it (GQA reads K/V GROUP times less than
one tile per query head would). Work index 0 is a sequence's *last* tile: causal tiles grow
with the index, and the longest start first (the short ones fill the tail of the wave).

Why these tiles (16-bit): BLOCK_M 128 rows with 8 warps is two warpgroups of 64 rows, the
shape sm_90's wgmma takes; there BLOCK_N is 64 keys at head_dim 128 (128 at <= 64): 208
registers, no spills, 99 KB of shared memory with 3 stages. Before sm_90 the dots are mma.sync
with the S tile in registers: 64 keys at head_dim 128 spill, so 32 (64 at <= 64). num_stages 3,
2 on the 99 KB parts (sm_86/89). The numbers: benchmarks/results/kernel-resources.md.
The key loop itself is attention_core's: causal tiles past the tile's last position are
skipped, whole tiles run unmasked, exp2 softmax with the scale folded into log2(e). Hopper's
TMA is not used: a 16-slot block scatters a 64-key tile over 4 pool blocks (a gather TMA only
sm_100 has), and device-side tensor descriptors need global scratch memory, which TensorRT's
AOT plugins cannot provide.

Verified under TRITON_INTERPRET=1 (CPU) and by AOT compilation for sm_80/sm_90 (registers,
shared memory, spills: plugins_cuda/resources.py); timed only by plugins_cuda/bench.py on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from plugins_cuda.attention_core import attend_rows
from plugins_cuda.common import step_kernel

SMALL_SMEM_ARCHS = (86, 87, 89, 120)


@dataclass(frozen=True)
class PrefillTiles:
    """Compile-time tiles of the prefill kernel; `for_shape` picks them."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def for_shape(cls, group: int, head_dim: int, element_bytes: int, arch: int = 90) -> PrefillTiles:
        if element_bytes == 4:  # verification builds: fp32 FMA dots, operands in registers
            return cls(max(32, triton.next_power_of_2(group)), 16, 4, 2)
        block_m = max(128, triton.next_power_of_2(group))
        # wgmma (sm_90) keeps the S tile's operands out of registers; with mma.sync 64 keys at
        # head_dim 128 need 255 registers and spill (sm_80: 84 B a thread)
        wide = 64 if arch >= 90 else 32
        block_n = wide if head_dim >= 128 else 2 * wide
        return cls(block_m, block_n, 8, 2 if arch in SMALL_SMEM_ARCHS else 3)

    def rows(self, group: int) -> int:  # tokens per tile
        return self.block_m // group


@step_kernel
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr,  # q [T, Hq*D], positions [T]
    query_start_ptr,  # [B + 1] int32: sequence b owns rows query_start[b] .. query_start[b + 1] - 1
    max_rows, table_width, out_ptr,
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(2)
    row0 = tl.load(query_start_ptr + seq).to(tl.int64)
    n_real = (tl.load(query_start_ptr + seq + 1) - row0).to(tl.int32)
    ROWS: tl.constexpr = BLOCK_M // GROUP
    t0 = (tl.cdiv(max_rows, ROWS) - 1 - tl.program_id(0)) * ROWS
    if t0 < n_real:  # tiles past a shorter sequence's rows have nothing to do
        acc, _m_i, l_i, q_rows, real = attend_rows(
            q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr, seq, row0, n_real, t0, 0, 1,
            table_width, SCALE, WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dims = tl.arange(0, HEAD_DIM)
        tl.store(out_ptr + q_rows[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty), mask=real[:, None])


def launch_prefill(q, k_cache, v_cache, tables, positions, query_start, max_rows: int, num_kv_heads: int,
                   group: int, head_dim: int, tiles: PrefillTiles, block_size: int, scale: float, window: int,
                   out) -> None:  # fmt: skip
    """One launch into `out`; tables int64 [B, W], positions int64 [T]."""
    batch = query_start.shape[0] - 1
    grid = (triton.cdiv(max_rows, tiles.rows(group)), num_kv_heads, batch)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, tables, positions, query_start, max_rows, tables.shape[1], out,
        SCALE=float(scale), WINDOW=int(window), NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip

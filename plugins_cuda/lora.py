"""Multi-LoRA as two Triton-language GPU kernels (Punica / S-LoRA "SGMV"): every token of a mixed batch
gets its own adapter's update, read from a pool of resident adapter slots.

    y[t, col_offset:col_offset + H_out] += scaling[s] * B[s] @ (A[s] @ x[t])      s = slot_of_token[t] >= 0

x [T, H_in] (fp16, bf16 or fp32; rows may be strided), A [S, R, H_in] (shrink) and B [S, H_out, R] (expand),
scaling [S] float32; y [T, >= col_offset + H_out] is updated in place and rows whose slot is -1 (the base
model) are never touched. Every slot is padded with zeros to the pool's rank R, so one pool holds adapters
of several ranks and the kernels compile once per pool rank R, not once per adapter rank.

Why shrink then expand: B @ A would be an H_out x H_in matrix per adapter; the two thin products cost
R * (H_in + H_out) per token and keep tmp = A @ x ([T, R] float32, a few KB) as the only round trip.
Why grouped by adapter: the tokens arrive as segments (contiguous runs with one slot: `segment_starts`
[G + 1], `segment_slots` [G]), a request's prefill chunk being one segment and a decode row a segment of
one (BGMV), so each program reads one slot's A or B tile once for up to BLOCK_T tokens. Programs:
shrink (segment, token tile, rank tile), looping over H_in; expand (segment, token tile, H_out tile), the
whole rank in one dot. Both accumulate in float32 (fp32 operands in IEEE fp32, common.dot); expand
rounds tmp to the weights' dtype for the dot, as Punica and vLLM do. No split over H_in: a batch of few
segments runs few shrink programs (a split-K shrink would fill the GPU there; not done).

Verified in float32 and float16 under TRITON_INTERPRET=1 against a float64 reference
(tests/test_lora_kernel.py). bfloat16 is unverified: the interpreter's tl.dot reads it as raw bits, and
nothing in this file has run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from plugins_cuda.common import dot, row_offsets

if TYPE_CHECKING:
    import torch

MIN_DOT = 16  # tl.dot's smallest tile side
# Index arrays a caller may view in a packed step buffer: specializing on their alignment gains nothing.
SEGMENT_ARRAYS = ("segment_starts_ptr", "segment_slots_ptr")


@triton.jit(do_not_specialize_on_alignment=SEGMENT_ARRAYS)
def lora_shrink_kernel(
    x_ptr: tl.tensor,  # [T, H_IN], rows x_stride apart
    a_ptr: tl.tensor,  # [S, RANK, H_IN]
    tmp_ptr: tl.tensor,  # [T, RANK] float32, written for the rows of adapter segments
    segment_starts_ptr: tl.tensor,  # [G + 1] int32
    segment_slots_ptr: tl.tensor,  # [G] int32; -1: no adapter, skipped
    x_stride: int,
    H_IN: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    segment = tl.program_id(0)
    end = tl.load(segment_starts_ptr + segment + 1)
    first = tl.load(segment_starts_ptr + segment) + tl.program_id(1) * BLOCK_T
    slot = tl.load(segment_slots_ptr + segment)
    if (slot >= 0) & (first < end):
        rows = first + tl.arange(0, BLOCK_T)
        row_ok = rows < end
        ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        rank_ok = ranks < RANK
        ks = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + row_offsets(rows, x_stride)
        a_rows = a_ptr + row_offsets(slot, RANK * H_IN) + ranks * H_IN
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for k0 in range(0, H_IN, BLOCK_K):
            k_ok = (k0 + ks) < H_IN
            x = tl.load(x_rows[:, None] + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_rows[None, :] + (k0 + ks)[:, None], mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
            acc += dot(x, a.to(x.dtype))  # [BLOCK_T, BLOCK_K] @ A[slot]^T tile [BLOCK_K, BLOCK_R]
        tmp = tmp_ptr + row_offsets(rows, RANK)[:, None] + ranks[None, :]
        tl.store(tmp, acc, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit(do_not_specialize_on_alignment=SEGMENT_ARRAYS)
def lora_expand_kernel(
    tmp_ptr: tl.tensor,  # [T, RANK] float32 (the shrink's output)
    b_ptr: tl.tensor,  # [S, H_OUT, RANK]
    scaling_ptr: tl.tensor,  # [S] float32
    y_ptr: tl.tensor,  # [T, >= col_offset + H_OUT], rows y_stride apart; updated in place
    segment_starts_ptr: tl.tensor,
    segment_slots_ptr: tl.tensor,
    y_stride: int,
    col_offset: int,
    H_OUT: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,  # RANK rounded up to a power of two >= MIN_DOT
    BLOCK_N: tl.constexpr,
) -> None:
    segment = tl.program_id(0)
    end = tl.load(segment_starts_ptr + segment + 1)
    first = tl.load(segment_starts_ptr + segment) + tl.program_id(1) * BLOCK_T
    slot = tl.load(segment_slots_ptr + segment)
    if (slot >= 0) & (first < end):
        rows = first + tl.arange(0, BLOCK_T)
        row_ok = rows < end
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < RANK
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H_OUT
        t = tl.load(
            tmp_ptr + row_offsets(rows, RANK)[:, None] + ranks[None, :],
            mask=row_ok[:, None] & rank_ok[None, :],
            other=0.0,
        )
        b_cols = b_ptr + row_offsets(slot, H_OUT * RANK) + cols * RANK
        b = tl.load(b_cols[None, :] + ranks[:, None], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        delta = dot(t.to(b.dtype), b) * tl.load(scaling_ptr + slot)  # tmp @ B[slot]^T tile
        out = y_ptr + row_offsets(rows, y_stride)[:, None] + col_offset + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoraTiles:
    block_t: int  # tokens per program: 16 (tl.dot's minimum) while every segment is short, else 64
    block_r: int  # the rank padded to a power of two >= 16: the expand's whole reduction
    shrink_r: int  # the shrink's rank tile, at most 64 wide
    block_k: int  # the shrink's H_in step
    block_n: int = 64  # the expand's H_out tile


def tiles_for(max_segment_len: int, rank: int, element_bytes: int) -> LoraTiles:
    """Decode batches (segments of 1..16 tokens) take 16-token tiles, prefill chunks 64; float32 operands
    (FMA units, registers) take the narrower H_in step."""
    block_r = max(MIN_DOT, triton.next_power_of_2(rank))
    block_t = MIN_DOT if max_segment_len <= MIN_DOT else 64
    return LoraTiles(block_t, block_r, min(block_r, 64), 64 if element_bytes == 4 else 128)


def segments_of(slot_of_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment_starts [G + 1], segment_slots [G]) int32 of each token's slot [T]: one segment per run of
    equal slots. A [G + 1] boundary list cannot leave gaps, so a run of -1 rows between two adapter runs
    stays a segment with slot -1 (both kernels skip it); -1 runs at either end are dropped."""
    import torch

    slots = slot_of_token.to(torch.int64).flatten()
    if slots.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=slots.device), slots.to(torch.int32)
    change = torch.nonzero(slots[1:] != slots[:-1]).flatten() + 1
    edges = torch.cat([change.new_zeros(1), change, change.new_full((1,), slots.numel())])
    run_slots = slots[edges[:-1]]
    kept = torch.nonzero(run_slots >= 0).flatten()
    if kept.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=slots.device), run_slots[:0].to(torch.int32)
    first, last = int(kept[0]), int(kept[-1])
    return edges[first : last + 2].to(torch.int32), run_slots[first : last + 1].to(torch.int32)


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    segment_starts: torch.Tensor,
    segment_slots: torch.Tensor,
    col_offset: int = 0,
    *,
    max_segment_len: int | None = None,
    tiles: LoraTiles | None = None,
) -> None:
    """y[:, col_offset:col_offset + H_out] += the segments' LoRA updates, in place, on torch tensors (CUDA,
    or CPU under TRITON_INTERPRET=1). `max_segment_len` sizes the grid; without it it is read from
    `segment_starts` (a device sync on CUDA). `tiles`: default `tiles_for(...)`."""
    import torch

    tokens, hidden_in = x.shape
    num_slots, rank, a_in = a.shape
    hidden_out = b.shape[1]
    if a_in != hidden_in or tuple(b.shape) != (num_slots, hidden_out, rank) or scaling.numel() != num_slots:
        raise ValueError(
            f"LoRA pools do not fit: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"scaling {tuple(scaling.shape)}"
        )
    if y.shape[0] != tokens or not 0 <= col_offset <= y.shape[1] - hidden_out:
        raise ValueError(f"y {tuple(y.shape)} has no columns [{col_offset}, {col_offset + hidden_out})")
    if x.stride(1) != 1 or y.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("x and y need unit column strides, the a and b pools contiguous storage")
    groups = segment_slots.numel()
    if groups == 0 or tokens == 0:
        return
    starts = segment_starts.to(torch.int32).contiguous()
    slots = segment_slots.to(torch.int32).contiguous()
    if max_segment_len is None:
        max_segment_len = int((starts[1:] - starts[:-1]).max())
    if max_segment_len <= 0:
        return
    tiles = tiles or tiles_for(max_segment_len, rank, x.element_size())
    if tiles.block_r < rank:
        raise ValueError(f"the expand's rank tile ({tiles.block_r}) must hold the whole rank ({rank})")
    token_tiles = triton.cdiv(max_segment_len, tiles.block_t)
    tmp = torch.empty((tokens, rank), dtype=torch.float32, device=x.device)
    lora_shrink_kernel[(groups, token_tiles, triton.cdiv(rank, tiles.shrink_r))](
        x,
        a,
        tmp,
        starts,
        slots,
        x.stride(0),
        H_IN=hidden_in,
        RANK=rank,
        BLOCK_T=tiles.block_t,
        BLOCK_R=tiles.shrink_r,
        BLOCK_K=tiles.block_k,
    )
    lora_expand_kernel[(groups, token_tiles, triton.cdiv(hidden_out, tiles.block_n))](
        tmp,
        b,
        scaling.to(torch.float32).contiguous(),
        y,
        starts,
        slots,
        y.stride(0),
        col_offset,
        H_OUT=hidden_out,
        RANK=rank,
        BLOCK_T=tiles.block_t,
        BLOCK_R=tiles.block_r,
        BLOCK_N=tiles.block_n,
    )


def lora_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    slot_of_token: torch.Tensor,
    col_offset: int = 0,
) -> torch.Tensor:
    """The update in float64, token by token from `slot_of_token` (no segments): a new float64 y."""
    out = y.double().clone()
    for t, slot in enumerate(slot_of_token.tolist()):
        if slot >= 0:
            delta = float(scaling[slot]) * (b[slot].double() @ (a[slot].double() @ x[t].double()))
            out[t, col_offset : col_offset + b.shape[1]] += delta
    return out

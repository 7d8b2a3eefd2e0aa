"""Paged attention over a quantized pool: the float kernels (plugins_cuda/paged_attention.py, same
grid, split-KV and merge) with every K/V tile dequantized in registers as it is loaded
(plugins_cuda/kv_codec.py): int8 codes times their (slot, kv head) scale, fp8 E4M3 values times the
layer's scale. Tile sizes follow q's dtype, not the pool's. The merge kernels are the float ones
(they read only float partials). Two layouts, as the float kernels:
- padded [batch, step] (`paged_attention_padded_quant`): the `trtserve::PagedAttentionInt8` /
  `PagedAttentionFP8` plugin kernels, AOT-compiled (no TensorRT plugin registers them yet);
- flat ragged (`launch_ragged_quant`): the torch backend's attention over an int8/fp8 pool
  (executors/torch/model.py).

Verified here only under TRITON_INTERPRET=1 (CPU); nothing in this file has run on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda import paged_attention as kernels
from plugins_cuda.aot import compile_kernel, triton_pointer
from plugins_cuda.attention_launch import (
    DEFAULT_SMS,
    ELEMENT_BYTES,
    SPLIT_SLOTS,
    AttentionTiles,
    _constexprs,
    _shape,
    num_splits,
    sm_count_of,
    work_items,
)  # fmt: skip
from plugins_cuda.common import step_kernel

KV_QUANT = {"int8": 1, "fp8": 2}  # kv_codec.dequantize's KV_QUANT


@triton.jit
def paged_attention_int8_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,  # q [B, S, Hq*D]; pools int8 [num_blocks, BLOCK_SIZE, Hkv*D], step written
    block_tables_ptr, positions_ptr,
    k_scales_ptr, v_scales_ptr,  # float32 [num_blocks, BLOCK_SIZE, Hkv]
    step, table_width, splits, out_ptr, partials_ptr,
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE_M: tl.constexpr, PREFILL_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(2)
    row0 = seq.to(tl.int64) * step
    n_real = (tl.load(positions_ptr + row0 + step - 1) - tl.load(positions_ptr + row0) + 1).to(tl.int32)
    kernels._dispatch(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr, out_ptr, partials_ptr,
                      k_scales_ptr, v_scales_ptr, seq, row0, n_real, step, step, splits, table_width, SCALE,
                      WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, DECODE_M, PREFILL_M, BLOCK_N, 1)  # fmt: skip


@triton.jit
def paged_attention_fp8_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,  # pools: uint8 E4M3 bits
    block_tables_ptr, positions_ptr,
    kv_scales_ptr,  # float32 [num_layers, 2]
    step, table_width, splits, out_ptr, partials_ptr,
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE_M: tl.constexpr, PREFILL_M: tl.constexpr,
    BLOCK_N: tl.constexpr, LAYER: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(2)
    row0 = seq.to(tl.int64) * step
    n_real = (tl.load(positions_ptr + row0 + step - 1) - tl.load(positions_ptr + row0) + 1).to(tl.int32)
    kernels._dispatch(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr, out_ptr, partials_ptr,
                      kv_scales_ptr + 2 * LAYER, kv_scales_ptr + 2 * LAYER + 1, seq, row0, n_real, step, step,
                      splits, table_width, SCALE, WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, DECODE_M,
                      PREFILL_M, BLOCK_N, 2)  # fmt: skip


@step_kernel
def paged_attention_ragged_quant_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr,  # q [T, Hq*D], positions [T]
    query_start_ptr,  # [B + 1] int32: sequence b owns rows query_start[b] .. query_start[b + 1] - 1
    k_scales_ptr, v_scales_ptr,  # int8: float32 [num_blocks, BLOCK_SIZE, Hkv]; fp8: the layer's K and V scales
    max_rows, table_width, splits, out_ptr, partials_ptr,
    SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE_M: tl.constexpr, PREFILL_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """The flat ragged layout (torch API) over an int8 (KV_QUANT 1) or fp8 (KV_QUANT 2) pool."""
    seq = tl.program_id(2)
    row0 = tl.load(query_start_ptr + seq).to(tl.int64)
    n_real = (tl.load(query_start_ptr + seq + 1) - row0).to(tl.int32)
    kernels._dispatch(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr, out_ptr, partials_ptr,
                      k_scales_ptr, v_scales_ptr, seq, row0, n_real, n_real, max_rows, splits, table_width, SCALE,
                      WINDOW, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, DECODE_M, PREFILL_M, BLOCK_N,
                      KV_QUANT)  # fmt: skip


def launch_ragged_quant(q, k_cache, v_cache, block_tables, positions, query_start, max_rows: int,
                        num_kv_heads: int, kind: str, scales: tuple, window: int = 0, scale: float | None = None,
                        sm_count: int | None = None):  # fmt: skip
    """attention_launch.launch_ragged over a quantized pool: `kind` "int8" with scales (k_scales, v_scales)
    [num_blocks, block_size, kv_heads] float32, or "fp8" with scales (k_scale, v_scale), one-element float32
    tensors (the layer's row of kv_scales). No host synchronization: graph-capturable."""
    import torch

    tiles, block_size = _shape(q.shape[1], k_cache, num_kv_heads, q.element_size())
    batch = query_start.shape[0] - 1
    out = torch.empty_like(q)
    if not batch:
        return out
    tables = block_tables[:batch].to(torch.int64).contiguous()
    splits = num_splits(batch, max_rows, tables.shape[1], block_size, num_kv_heads, tiles,
                        sm_count or sm_count_of(q.device))  # fmt: skip
    partials = torch.empty((batch * num_kv_heads * splits, tiles.slot_width), dtype=torch.float32, device=q.device)
    scale = tiles.head_dim**-0.5 if scale is None else scale
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    paged_attention_ragged_quant_kernel[(work_items(max_rows, splits, tiles), num_kv_heads, batch)](
        q.contiguous(), k_cache, v_cache, tables, positions.to(torch.int64).contiguous(), query_start, *scales,
        max_rows, tables.shape[1], splits, out, partials,
        **_constexprs(scale, window, num_kv_heads, tiles, block_size), KV_QUANT=KV_QUANT[kind], **launch,
    )  # fmt: skip
    if splits > 1:
        kernels.paged_attention_ragged_merge_kernel[(1, num_kv_heads, batch)](
            partials, query_start, max_rows, splits, out, NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group,
            HEAD_DIM=tiles.head_dim, DECODE_M=tiles.decode_m, **launch,
        )  # fmt: skip
    return out


def paged_attention_padded_quant(q, k_cache, v_cache, block_tables, positions, num_kv_heads: int, scale: float,
                                 kind: str, scales: tuple, layer: int = 0, window: int = 0,
                                 sm_count: int = DEFAULT_SMS):  # fmt: skip
    """Both plugin kernels over a quantized pool, as TensorRT would launch them: `kind` "int8" with
    scales (k_scales, v_scales) [num_blocks, block_size, kv_heads], or "fp8" with scales (kv_scales,)
    [num_layers, 2] and `layer`. q [B, S, Hq*D]; returns [B, S, Hq*D], zeros in padding rows."""
    import torch

    batch, step, width = q.shape
    tiles, block_size = _shape(width, k_cache, num_kv_heads, q.element_size())
    tables = block_tables.to(torch.int64).contiguous()
    splits = num_splits(batch, step, tables.shape[1], block_size, num_kv_heads, tiles, sm_count)
    partials = torch.empty((SPLIT_SLOTS, tiles.slot_width), dtype=torch.float32, device=q.device)
    positions = positions.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    constexprs = _constexprs(scale, window, num_kv_heads, tiles, block_size)
    kernel = paged_attention_int8_kernel if kind == "int8" else paged_attention_fp8_kernel
    if kind == "fp8":
        constexprs["LAYER"] = layer
    kernel[(work_items(step, splits, tiles), num_kv_heads, batch)](
        q.contiguous(), k_cache, v_cache, tables, positions, *(s.contiguous() for s in scales), step, tables.shape[1],
        splits, out, partials, **constexprs, **launch,
    )  # fmt: skip
    kernels.paged_attention_merge_kernel[(1, num_kv_heads, batch)](
        out, partials, tables, positions, step, splits, out,
        NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group, HEAD_DIM=tiles.head_dim, DECODE_M=tiles.decode_m, **launch,
    )  # fmt: skip
    return out


def attention_quant_signature(dtype: str, kind: str) -> dict[str, str]:
    """The quantized plugin entry's parameters, in TensorRT's AOT order."""
    pointer, pool = triton_pointer(dtype), "*i8" if kind == "int8" else "*u8"
    scales = {"k_scales_ptr": "*fp32", "v_scales_ptr": "*fp32"} if kind == "int8" else {"kv_scales_ptr": "*fp32"}
    names = ["SCALE", "WINDOW", "NUM_KV_HEADS", "GROUP", "HEAD_DIM", "BLOCK_SIZE", "DECODE_M", "PREFILL_M", "BLOCK_N"]
    return {
        "q_ptr": pointer, "k_cache_ptr": pool, "v_cache_ptr": pool, "block_tables_ptr": "*i64",
        "positions_ptr": "*i64", **scales, "step": "i32", "table_width": "i32", "splits": "i32", "out_ptr": pointer,
        "partials_ptr": "*fp32", **dict.fromkeys(names + (["LAYER"] if kind == "fp8" else []), "constexpr"),
    }  # fmt: skip


def compile_attention_quant(arch: int, dtype: str, kind: str, num_kv_heads: int, group: int, head_dim: int,
                            block_size: int, scale: float, window: int = 0, layer: int = 0):  # fmt: skip
    """AOT-compile the quantized attention kernel for one architecture; needs no GPU."""
    tiles = AttentionTiles(group, head_dim, ELEMENT_BYTES[dtype])
    constexprs = _constexprs(scale, window, num_kv_heads, tiles, block_size)
    if kind == "fp8":
        constexprs["LAYER"] = layer
    kernel = paged_attention_int8_kernel if kind == "int8" else paged_attention_fp8_kernel
    return compile_kernel(kernel, attention_quant_signature(dtype, kind), constexprs, arch,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip

"""Paged KV write into a quantized pool (the `trtserve::PagedKVWriteInt8` / `PagedKVWriteFP8` plugins).

The float kernel's contract (plugins_cuda/kv_write.py: one program per padded [batch, step] row,
padding rows write nothing, TensorRT's AOT argument order) with the row quantized as it is stored
(plugins_cuda/kv_codec.py): int8 writes each kv head's codes and its float32 scale into the scale
pool [num_blocks, block_size, kv_heads]; fp8 writes E4M3 bits with the layer's static scales
kv_scales[LAYER] (float32 [num_layers, 2]: K, V). Compiled without FMA contraction so that the
stored bytes are numpy's (executors/kv_quant.py).

Verified here only under TRITON_INTERPRET=1 (CPU); nothing in this file has run on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda.aot import compile_kernel, triton_pointer
from plugins_cuda.common import step_kernel
from plugins_cuda.kv_codec import encode_fp8, quantize_int8


@triton.jit
def _row_slot(row, block_tables_ptr, positions_ptr, step, table_width, BLOCK_SIZE: tl.constexpr):
    b = row // step
    pos = tl.load(positions_ptr + row).to(tl.int64)
    block = tl.load(block_tables_ptr + b * table_width + pos // BLOCK_SIZE).to(tl.int64)
    return block * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _write_int8(x_ptr, cache_ptr, scales_ptr, row, slot, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):  # fmt: skip
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    ok = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cols = heads[:, None] * HEAD_DIM + dims[None, :]
    x = tl.load(x_ptr + row.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + cols, mask=ok, other=0.0).to(tl.float32)
    codes, scales = quantize_int8(x)
    tl.store(cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + cols, codes, mask=ok)
    tl.store(scales_ptr + slot * NUM_KV_HEADS + heads, scales, mask=heads < NUM_KV_HEADS)


@step_kernel
def paged_kv_write_int8_kernel(
    k_ptr, v_ptr,  # [B, S, KV_WIDTH] float
    k_cache_in_ptr, v_cache_in_ptr,  # int8 [num_blocks, BLOCK_SIZE, KV_WIDTH]; aliased by the outputs, unused
    block_tables_ptr, positions_ptr, seq_lens_ptr,  # int64 [B, table_width], [B, S], [B]
    k_scales_in_ptr, v_scales_in_ptr,  # float32 [num_blocks, BLOCK_SIZE, NUM_KV_HEADS]; aliased, unused
    step, table_width,
    k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,  # outputs: the pools, written in place
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if row % step < tl.load(seq_lens_ptr + row // step):
        slot = _row_slot(row, block_tables_ptr, positions_ptr, step, table_width, BLOCK_SIZE)
        _write_int8(k_ptr, k_cache_ptr, k_scales_ptr, row, slot, NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, DIM_PAD)
        _write_int8(v_ptr, v_cache_ptr, v_scales_ptr, row, slot, NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, DIM_PAD)


@step_kernel
def paged_kv_write_fp8_kernel(
    k_ptr, v_ptr, k_cache_in_ptr, v_cache_in_ptr,  # pools: uint8 E4M3 bits; aliased by the outputs, unused
    block_tables_ptr, positions_ptr, seq_lens_ptr,
    kv_scales_ptr,  # float32 [num_layers, 2]
    step, table_width,
    k_cache_ptr, v_cache_ptr,
    KV_WIDTH: tl.constexpr, KV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, LAYER: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if row % step < tl.load(seq_lens_ptr + row // step):
        slot = _row_slot(row, block_tables_ptr, positions_ptr, step, table_width, BLOCK_SIZE)
        cols = tl.arange(0, KV_PAD)
        ok = cols < KV_WIDTH
        src = row.to(tl.int64) * KV_WIDTH + cols
        k = tl.load(k_ptr + src, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + src, mask=ok, other=0.0).to(tl.float32)
        tl.store(k_cache_ptr + slot * KV_WIDTH + cols, encode_fp8(k, tl.load(kv_scales_ptr + 2 * LAYER)), mask=ok)
        tl.store(v_cache_ptr + slot * KV_WIDTH + cols, encode_fp8(v, tl.load(kv_scales_ptr + 2 * LAYER + 1)), mask=ok)


def paged_kv_write_int8(k, v, k_cache, v_cache, block_tables, positions, seq_lens, k_scales, v_scales) -> None:
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); writes codes and scales in place."""
    import torch

    batch, step, _ = k.shape
    heads, head_dim = k_scales.shape[2], k_cache.shape[2] // k_scales.shape[2]
    int64 = [t.to(torch.int64).contiguous() for t in (block_tables, positions, seq_lens)]
    paged_kv_write_int8_kernel[(batch * step,)](
        k.contiguous(), v.contiguous(), k_cache, v_cache, *int64, k_scales, v_scales, step, block_tables.shape[1],
        k_cache, v_cache, k_scales, v_scales, NUM_KV_HEADS=heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], enable_fp_fusion=False,
    )  # fmt: skip


def paged_kv_write_fp8(k, v, k_cache, v_cache, block_tables, positions, seq_lens, kv_scales, layer: int) -> None:
    import torch

    batch, step, kv_width = k.shape
    int64 = [t.to(torch.int64).contiguous() for t in (block_tables, positions, seq_lens)]
    paged_kv_write_fp8_kernel[(batch * step,)](
        k.contiguous(), v.contiguous(), k_cache, v_cache, *int64, kv_scales.contiguous(), step,
        block_tables.shape[1], k_cache, v_cache, KV_WIDTH=kv_width, KV_PAD=triton.next_power_of_2(kv_width),
        BLOCK_SIZE=k_cache.shape[1], LAYER=layer, enable_fp_fusion=False,
    )  # fmt: skip


def compile_int8_for_arch(arch: int, dtype: str, num_kv_heads: int, head_dim: int, block_size: int):
    """AOT-compile the int8 write for one architecture; needs no GPU."""
    pointer = triton_pointer(dtype)
    signature = {
        "k_ptr": pointer, "v_ptr": pointer, "k_cache_in_ptr": "*i8", "v_cache_in_ptr": "*i8",
        "block_tables_ptr": "*i64", "positions_ptr": "*i64", "seq_lens_ptr": "*i64",
        "k_scales_in_ptr": "*fp32", "v_scales_in_ptr": "*fp32", "step": "i32", "table_width": "i32",
        "k_cache_ptr": "*i8", "v_cache_ptr": "*i8", "k_scales_ptr": "*fp32", "v_scales_ptr": "*fp32",
        **dict.fromkeys(("NUM_KV_HEADS", "HEAD_DIM", "HEADS_PAD", "DIM_PAD", "BLOCK_SIZE"), "constexpr"),
    }  # fmt: skip
    constexprs = {"NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim, "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
                  "DIM_PAD": triton.next_power_of_2(head_dim), "BLOCK_SIZE": block_size}  # fmt: skip
    return compile_kernel(paged_kv_write_int8_kernel, signature, constexprs, arch, fp_fusion=False)


def compile_fp8_for_arch(arch: int, dtype: str, kv_width: int, block_size: int, layer: int):
    """AOT-compile the fp8 write of one layer for one architecture; needs no GPU."""
    pointer = triton_pointer(dtype)
    signature = {
        "k_ptr": pointer, "v_ptr": pointer, "k_cache_in_ptr": "*u8", "v_cache_in_ptr": "*u8",
        "block_tables_ptr": "*i64", "positions_ptr": "*i64", "seq_lens_ptr": "*i64", "kv_scales_ptr": "*fp32",
        "step": "i32", "table_width": "i32", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8",
        **dict.fromkeys(("KV_WIDTH", "KV_PAD", "BLOCK_SIZE", "LAYER"), "constexpr"),
    }  # fmt: skip
    constexprs = {"KV_WIDTH": kv_width, "KV_PAD": triton.next_power_of_2(kv_width), "BLOCK_SIZE": block_size,
                  "LAYER": layer}  # fmt: skip
    return compile_kernel(paged_kv_write_fp8_kernel, signature, constexprs, arch, fp_fusion=False)

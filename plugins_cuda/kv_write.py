"""Paged KV write as a Triton-language GPU kernel (the `trtserve::PagedKVWrite` plugin).

Writes this step's K/V rows into the paged pool in place, over the plugin graph's padded
[batch, step] layout (engine_format/INTERFACE.md): row `[b, i]` with `i < seq_lens[b]` goes to slot
`block_tables[b, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE`, `p = positions[b, i]`;
padding rows write nothing. One program per row. The argument order is TensorRT's AOT plugin
convention: the node's inputs (the pool inputs too, which the outputs alias), then int32
scalars, then the outputs.

Verified here only under TRITON_INTERPRET=1 (CPU) and by AOT compilation for sm_80/89/90;
nothing in this file has run on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda.aot import compile_kernel, triton_pointer
from plugins_cuda.common import step_kernel


@step_kernel
def paged_kv_write_kernel(
    k_ptr,  # [B, S, KV_WIDTH]
    v_ptr,
    k_cache_in_ptr,  # [num_blocks, BLOCK_SIZE, KV_WIDTH]; same memory as k_cache_ptr (aliased), unused
    v_cache_in_ptr,
    block_tables_ptr,  # [B, table_width] int64
    positions_ptr,  # [B, S] int64
    seq_lens_ptr,  # [B] int64
    step,  # S
    table_width,  # M
    k_cache_ptr,  # outputs: the pool, written in place
    v_cache_ptr,
    KV_WIDTH: tl.constexpr,
    KV_PAD: tl.constexpr,  # KV_WIDTH rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // step
    if row % step < tl.load(seq_lens_ptr + b):
        pos = tl.load(positions_ptr + row).to(tl.int64)
        block = tl.load(block_tables_ptr + b * table_width + pos // BLOCK_SIZE).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        cols = tl.arange(0, KV_PAD)
        ok = cols < KV_WIDTH
        src = row.to(tl.int64) * KV_WIDTH + cols
        tl.store(k_cache_ptr + slot * KV_WIDTH + cols, tl.load(k_ptr + src, mask=ok), mask=ok)
        tl.store(v_cache_ptr + slot * KV_WIDTH + cols, tl.load(v_ptr + src, mask=ok), mask=ok)


def paged_kv_write(k, v, k_cache, v_cache, block_tables, positions, seq_lens) -> None:
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); writes the pools in place."""
    import torch

    batch, step, kv_width = k.shape
    int64 = [t.to(torch.int64).contiguous() for t in (block_tables, positions, seq_lens)]
    paged_kv_write_kernel[(batch * step,)](
        k.contiguous(), v.contiguous(), k_cache, v_cache, *int64, step, block_tables.shape[1], k_cache, v_cache,
        KV_WIDTH=kv_width, KV_PAD=triton.next_power_of_2(kv_width), BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def compile_for_arch(arch: int, dtype: str, kv_width: int, block_size: int):
    """AOT-compile for one GPU architecture (80, 89, 90); needs no GPU. Returns Triton's
    CompiledKernel: `.asm["ptx"]`, `.asm["cubin"]`, `.metadata`."""
    pointer = triton_pointer(dtype)
    signature = {
        "k_ptr": pointer, "v_ptr": pointer, "k_cache_in_ptr": pointer, "v_cache_in_ptr": pointer,
        "block_tables_ptr": "*i64", "positions_ptr": "*i64", "seq_lens_ptr": "*i64", "step": "i32",
        "table_width": "i32", "k_cache_ptr": pointer, "v_cache_ptr": pointer,
        "KV_WIDTH": "constexpr", "KV_PAD": "constexpr", "BLOCK_SIZE": "constexpr",
    }  # fmt: skip
    constexprs = {"KV_WIDTH": kv_width, "KV_PAD": triton.next_power_of_2(kv_width), "BLOCK_SIZE": block_size}
    return compile_kernel(paged_kv_write_kernel, signature, constexprs, arch)

"""Paged attention as a Triton-language GPU kernel (the TensorRT plugin's implementation).

Same contract as the CPU kernel (runtime/backends/kernels/paged_attention.c) and the segment
interface (engine_format/INTERFACE.md): a flat ragged batch of query tokens, each attending to its
own sequence's keys at positions [max(0, pos - window + 1), pos] through a block table, K/V
read in place from the paged pool. One program per (query token, kv head); the query heads
sharing the kv head (GQA) are one tile, so K/V blocks are loaded once per group.

Verified here only under TRITON_INTERPRET=1 (CPU) and by AOT compilation for sm_80/89/90;
nothing in this file has run on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda.aot import compile_kernel, triton_pointer

MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _attend(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, token, seq, pos, scale, window, table_width,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Query token `token` (row of q/out) of block-table row `seq` at position `pos`, one kv head."""
    kv_head = tl.program_id(1)
    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)

    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    q_row = NUM_KV_HEADS * GROUP * HEAD_DIM
    q_offsets = token * q_row + (kv_head * GROUP + heads)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=heads[:, None] < GROUP, other=0.0)

    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    keys = tl.arange(0, BLOCK_SIZE)
    kv_row = NUM_KV_HEADS * HEAD_DIM
    for block_index in range(first // BLOCK_SIZE, pos // BLOCK_SIZE + 1):
        block = tl.load(block_tables_ptr + seq * table_width + block_index)
        kv_offsets = (block * BLOCK_SIZE + keys)[:, None] * kv_row + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [GROUP_PAD, BLOCK_SIZE]
        key_pos = block_index * BLOCK_SIZE + keys
        visible = (key_pos >= first) & (key_pos <= pos)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp(row_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        row_max = new_max
    out = acc / row_sum[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=heads[:, None] < GROUP)


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, Hq*D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv*D]
    v_cache_ptr,
    out_ptr,  # [T, Hq*D]
    block_tables_ptr,  # [B, table_width] int32
    seq_of_token_ptr,  # [T] int32
    positions_ptr,  # [T] int32
    scale,
    window,  # 0 = full attention
    table_width,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Flat ragged tokens (the CPU segment layout)."""
    token = tl.program_id(0)
    seq = tl.load(seq_of_token_ptr + token)
    pos = tl.load(positions_ptr + token)
    _attend(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, token, seq, pos, scale, window, table_width,
            NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE)  # fmt: skip


@triton.jit
def paged_attention_padded_kernel(
    q_ptr,  # [B, S, Hq*D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv*D], this step's rows already written (PagedKVWrite)
    v_cache_ptr,
    block_tables_ptr,  # [B, table_width] int64
    positions_ptr,  # [B, S] int64
    step,  # S
    table_width,
    out_ptr,  # [B, S, Hq*D]
    SCALE: tl.constexpr,
    WINDOW: tl.constexpr,  # 0 = full attention
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """The `trtserve::PagedAttention` plugin: the padded [batch, step] layout, TensorRT's AOT
    argument order (inputs, int32 scalars, outputs). Padding rows repeat their sequence's last
    position, so they compute a valid (discarded) row."""
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token).to(tl.int32)
    _attend(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, token, token // step, pos, SCALE, WINDOW,
            table_width, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE)  # fmt: skip


def group_pad(group: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(group))


def paged_attention(q, k_cache, v_cache, block_tables, seq_of_token, positions, num_kv_heads: int, window: int = 0):
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); returns [T, Hq*D]."""
    import torch

    tokens, width = q.shape
    block_size, kv_width = k_cache.shape[1], k_cache.shape[2]
    head_dim = kv_width // num_kv_heads
    group = width // kv_width
    if head_dim < MIN_DOT or block_size < MIN_DOT:
        raise ValueError(f"head_dim and block_size must be >= {MIN_DOT} (got {head_dim}, {block_size})")
    out = torch.empty_like(q)
    paged_attention_kernel[(tokens, num_kv_heads)](
        q, k_cache, v_cache, out,
        block_tables.to(torch.int32), seq_of_token.to(torch.int32), positions.to(torch.int32),
        head_dim**-0.5, window, block_tables.shape[1],
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad(group), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )  # fmt: skip
    return out


def compile_for_arch(arch: int, dtype: str, num_kv_heads: int, group: int, head_dim: int, block_size: int):
    """AOT-compile the kernel for one GPU architecture (80, 89, 90); needs no GPU.

    Returns Triton's CompiledKernel: `.asm["ptx"]`, `.asm["cubin"]`, `.metadata`."""
    pointer = triton_pointer(dtype)
    signature = {
        "q_ptr": pointer, "k_cache_ptr": pointer, "v_cache_ptr": pointer, "out_ptr": pointer,
        "block_tables_ptr": "*i32", "seq_of_token_ptr": "*i32", "positions_ptr": "*i32",
        "scale": "fp32", "window": "i32", "table_width": "i32",
        "NUM_KV_HEADS": "constexpr", "GROUP": "constexpr", "GROUP_PAD": "constexpr",
        "HEAD_DIM": "constexpr", "BLOCK_SIZE": "constexpr",
    }  # fmt: skip
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads, "GROUP": group, "GROUP_PAD": group_pad(group),
        "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size,
    }  # fmt: skip
    return compile_kernel(paged_attention_kernel, signature, constexprs, arch)


def paged_attention_padded(q, k_cache, v_cache, block_tables, positions, num_kv_heads: int, scale: float,
                           window: int = 0):  # fmt: skip
    """The plugin's kernel on torch tensors: q [B, S, Hq*D], positions [B, S]; returns [B, S, Hq*D]."""
    import torch

    batch, step, width = q.shape
    block_size, kv_width = k_cache.shape[1], k_cache.shape[2]
    group = width // kv_width
    out = torch.empty_like(q)
    paged_attention_padded_kernel[(batch * step, num_kv_heads)](
        q.contiguous(), k_cache, v_cache, block_tables.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous(), step, block_tables.shape[1], out,
        SCALE=scale, WINDOW=window, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad(group),
        HEAD_DIM=kv_width // num_kv_heads, BLOCK_SIZE=block_size,
    )  # fmt: skip
    return out


PADDED_CONSTEXPRS = ("SCALE", "WINDOW", "NUM_KV_HEADS", "GROUP", "GROUP_PAD", "HEAD_DIM", "BLOCK_SIZE")


def padded_signature(dtype: str) -> dict[str, str]:
    pointer = triton_pointer(dtype)
    return {
        "q_ptr": pointer, "k_cache_ptr": pointer, "v_cache_ptr": pointer, "block_tables_ptr": "*i64",
        "positions_ptr": "*i64", "step": "i32", "table_width": "i32", "out_ptr": pointer,
        **dict.fromkeys(PADDED_CONSTEXPRS, "constexpr"),
    }  # fmt: skip


def compile_padded_for_arch(arch: int, dtype: str, num_kv_heads: int, group: int, head_dim: int, block_size: int,
                            scale: float, window: int = 0):  # fmt: skip
    """AOT-compile the plugin entry (padded layout) for one architecture; needs no GPU."""
    constexprs = {
        "SCALE": scale, "WINDOW": window, "NUM_KV_HEADS": num_kv_heads, "GROUP": group,
        "GROUP_PAD": group_pad(group), "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size,
    }  # fmt: skip
    return compile_kernel(paged_attention_padded_kernel, padded_signature(dtype), constexprs, arch)

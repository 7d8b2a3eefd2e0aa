"""Fused RMSNorm -> QKV projection -> RoPE as a Triton-language GPU kernel (the TensorRT
plugin's implementation for the attention prologue of every decoder layer).

    qkv = rope(rms_norm(x) @ W_qkv (+ bias))      x [T, H], W_qkv [H, (Hq + 2 Hkv) * D]

One program per (tile of BLOCK_T tokens, output head); q, k and v are separate outputs, in
TensorRT's AOT plugin argument order (inputs, int32 scalars, outputs; eps is a constexpr).
The head's two rotary halves are accumulated as separate [BLOCK_T, D/2] tiles, so RoPE
(rotate-half, as HF Llama) is applied in registers before the single store; V heads are
stored unrotated. The RMS statistics of the tile's rows are computed in a first pass over H.
Weights: float16, bfloat16 or float32 (the calibrated INT4/FP8 formats are not covered by
this kernel). Verified only under TRITON_INTERPRET=1 and by AOT compilation; nothing here
has run on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda.aot import compile_kernel, triton_pointer

MIN_DOT = 16


@triton.jit
def fused_rmsnorm_qkv_rope_kernel(
    x_ptr,  # [T, H]
    norm_ptr,  # [H]
    w_ptr,  # [H, HEADS * D]
    bias_ptr,  # [HEADS * D] (ignored unless HAS_BIAS)
    cos_ptr,  # [max_pos, D / 2] float32
    sin_ptr,
    positions_ptr,  # [T] int32 or int64
    tokens,
    q_ptr,  # [T, Hq * D]
    k_ptr,  # [T, Hkv * D]
    v_ptr,  # [T, Hkv * D]
    EPS: tl.constexpr,
    HIDDEN: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    WIDTH: tl.constexpr = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    ks = tl.arange(0, BLOCK_K)

    # Pass 1: RMS of each row (float32).
    squares = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * HIDDEN + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & ((k0 + ks) < HIDDEN)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        squares += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(squares / HIDDEN + EPS)

    # Pass 2: normalized rows times this head's two column halves.
    halves = tl.arange(0, HALF)
    col_lo = head * HEAD_DIM + halves
    acc_lo = tl.zeros([BLOCK_T, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_T, HALF], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = (k0 + ks) < HIDDEN
        x = tl.load(x_ptr + rows[:, None] * HIDDEN + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        g = tl.load(norm_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        xn = (x * rstd[:, None] * g[None, :]).to(w_ptr.dtype.element_ty)
        w_rows = (k0 + ks)[:, None] * WIDTH
        w_lo = tl.load(w_ptr + w_rows + col_lo[None, :], mask=k_ok[:, None], other=0.0)
        w_hi = tl.load(w_ptr + w_rows + (col_lo + HALF)[None, :], mask=k_ok[:, None], other=0.0)
        acc_lo += tl.dot(xn, w_lo).to(tl.float32)
        acc_hi += tl.dot(xn, w_hi).to(tl.float32)
    if HAS_BIAS:
        acc_lo += tl.load(bias_ptr + col_lo).to(tl.float32)[None, :]
        acc_hi += tl.load(bias_ptr + col_lo + HALF).to(tl.float32)[None, :]

    # RoPE on Q and K heads (rotate-half); V heads pass through.
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        pos = tl.load(positions_ptr + rows, mask=row_ok, other=0)
        cos = tl.load(cos_ptr + pos[:, None] * HALF + halves[None, :], mask=row_ok[:, None], other=1.0)
        sin = tl.load(sin_ptr + pos[:, None] * HALF + halves[None, :], mask=row_ok[:, None], other=0.0)
        lo = acc_lo * cos - acc_hi * sin
        hi = acc_hi * cos + acc_lo * sin
        acc_lo, acc_hi = lo, hi
    if head < NUM_Q_HEADS:
        _store_head(q_ptr, NUM_Q_HEADS * HEAD_DIM, head * HEAD_DIM, rows, row_ok, acc_lo, acc_hi, HALF)
    elif head < NUM_Q_HEADS + NUM_KV_HEADS:
        _store_head(k_ptr, NUM_KV_HEADS * HEAD_DIM, (head - NUM_Q_HEADS) * HEAD_DIM, rows, row_ok, acc_lo, acc_hi, HALF)
    else:
        col = (head - NUM_Q_HEADS - NUM_KV_HEADS) * HEAD_DIM
        _store_head(v_ptr, NUM_KV_HEADS * HEAD_DIM, col, rows, row_ok, acc_lo, acc_hi, HALF)


@triton.jit
def _store_head(out_ptr, width, col, rows, row_ok, acc_lo, acc_hi, HALF: tl.constexpr):
    halves = tl.arange(0, HALF)
    out_rows = out_ptr + rows[:, None] * width + col
    tl.store(out_rows + halves[None, :], acc_lo.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(out_rows + (halves + HALF)[None, :], acc_hi.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def tile_sizes(hidden: int) -> tuple[int, int]:
    return MIN_DOT, min(64, max(MIN_DOT, triton.next_power_of_2(hidden)))


def fused_rmsnorm_qkv_rope(x, norm_weight, w_qkv, bias, cos, sin, positions, num_q_heads, num_kv_heads, eps):
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); returns q, k, v
    concatenated, [T, (Hq+2Hkv)*D]."""
    import torch

    tokens, hidden = x.shape
    heads = num_q_heads + 2 * num_kv_heads
    head_dim = w_qkv.shape[1] // heads
    if head_dim // 2 < MIN_DOT or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= {2 * MIN_DOT} (got {head_dim})")
    block_t, block_k = tile_sizes(hidden)
    q, k, v = (torch.empty((tokens, n * head_dim), dtype=x.dtype, device=x.device)
               for n in (num_q_heads, num_kv_heads, num_kv_heads))  # fmt: skip
    fused_rmsnorm_qkv_rope_kernel[(triton.cdiv(tokens, block_t), heads)](
        x, norm_weight, w_qkv, bias if bias is not None else w_qkv, cos, sin, positions.to(torch.int32), tokens,
        q, k, v, EPS=eps, HIDDEN=hidden, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_K=block_k, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return torch.cat([q, k, v], dim=1)


def compile_for_arch(arch: int, dtype: str, hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     has_bias: bool = False, eps: float = 1e-5, positions: str = "*i32",
                     cos_sin: str = "*fp32"):  # fmt: skip
    """AOT-compile for one GPU architecture (80, 89, 90); needs no GPU. The plugin passes
    int64 positions and cos/sin in the model dtype (`positions="*i64"`, `cos_sin=pointer`)."""
    pointer = triton_pointer(dtype)
    block_t, block_k = tile_sizes(hidden)
    signature = {
        "x_ptr": pointer, "norm_ptr": pointer, "w_ptr": pointer, "bias_ptr": pointer,
        "cos_ptr": cos_sin, "sin_ptr": cos_sin, "positions_ptr": positions, "tokens": "i32",
        "q_ptr": pointer, "k_ptr": pointer, "v_ptr": pointer, "EPS": "constexpr", "HIDDEN": "constexpr",
        "NUM_Q_HEADS": "constexpr", "NUM_KV_HEADS": "constexpr", "HEAD_DIM": "constexpr",
        "BLOCK_T": "constexpr", "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr",
    }  # fmt: skip
    constexprs = {
        "EPS": eps, "HIDDEN": hidden, "NUM_Q_HEADS": num_q_heads, "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim,
        "BLOCK_T": block_t, "BLOCK_K": block_k, "HAS_BIAS": has_bias,
    }  # fmt: skip
    return compile_kernel(fused_rmsnorm_qkv_rope_kernel, signature, constexprs, arch)

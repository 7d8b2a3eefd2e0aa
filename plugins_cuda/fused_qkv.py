"""Fused RMSNorm -> QKV projection -> RoPE as a Triton-language GPU kernel (the TensorRT
plugin's implementation for the attention prologue of every decoder layer).

    qkv = rope(rms_norm(x) @ W_qkv (+ bias))      x [T, H], W_qkv [H, (Hq + 2 Hkv) * D]

One program per (tile of BLOCK_T tokens, tile of BLOCK_P rotary pairs): pair p is the
columns (c, c + D/2) of head p // (D/2), c = head * D + p % (D/2), so a tile spans one or
several heads (q, k and v alike) and both halves of a rotation sit in the same program:
RoPE (rotate-half, as HF Llama) is applied in registers before the single store, V pairs
are stored unrotated. The rows' RMS statistic is computed once per program in a first
pass over the tile's x (L2-resident; it keeps the normalized operand, x * rstd * g cast to
the weight dtype, exactly the reference's), then one K loop feeds tl.dot. Two tile shapes
(TACTICS): `decode`, 16-token tiles and narrow column tiles so a few tokens still spread the
weight read over every SM; `prefill`, 64-token tiles that read the weights a quarter as
often. They are the plugin's two tactics: TensorRT times them and keeps the faster
(plugins_cuda/trt_plugins.py; whether it picks per optimization profile is unverified).

Why the torch launcher uses neither: fusing saves the normalized-x and qkv round trips and two
launches a layer, but one Triton tile loses to cuBLAS at every token count measured on an H100
(hidden 4,096, 32/8 heads, bf16, CUDA-graph replays; benchmarks/results/gpu-h100-2026-11-26): the
GEMM tactic (plugins_cuda/prologue_gemm.py: cuBLAS matmul with RMSNorm and bias + RoPE fused
around it) takes 27 µs at 1-65 tokens and 184 µs at 2,048, the fused decode tiles 53-147 µs and
2,664 µs. So `default_tactic` is the GEMM tactic at every count (smaller hidden sizes were not
measured). The TensorRT plugin keeps its two fused tactics; the GEMM tactic there would be
RMSNorm + MatMul left to TensorRT with a RoPE epilogue plugin (a plugin-graph change, not made).

Weights: float16, bfloat16 or float32 (the calibrated INT4/FP8 formats keep their Q/DQ
MatMul in TensorRT and bypass this plugin). Every tactic matches its float64 reference on an H100
(`python -m plugins_cuda.check`) and under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from plugins_cuda.aot import compile_kernel, triton_pointer
from plugins_cuda.common import dot, row_offsets, step_kernel

MIN_DOT = 16


@dataclass(frozen=True)
class PrologueTiles:
    block_t: int  # tokens per program
    block_p: int  # rotary pairs (column pairs) per program
    block_k: int  # hidden-dimension step
    num_warps: int = 4
    num_stages: int = 3


TACTICS = {"decode": PrologueTiles(16, 16, 128), "prefill": PrologueTiles(64, 64, 64)}


def default_tactic(tokens: int) -> str:
    """The torch launcher's choice: the GEMM tactic, the fastest measured at every token count (module doc).
    The fused tiles stay the TensorRT plugin's tactics."""
    return "gemm"


def tiles_for(tactic: str, element_bytes: int) -> PrologueTiles:
    """float32 (verification builds) multiplies on the FMA units, operands in registers: its
    prefill tiles are halved so that they neither spill nor pass sm_89's 99 KB of shared memory."""
    if element_bytes == 4 and tactic == "prefill":
        return PrologueTiles(32, 32, 32, num_stages=2)
    return TACTICS[tactic]


@step_kernel
def fused_rmsnorm_qkv_rope_kernel(
    x_ptr,  # [T, H]
    norm_ptr,  # [H]
    w_ptr,  # [H, HEADS * D]
    bias_ptr,  # [HEADS * D] (ignored unless HAS_BIAS)
    cos_ptr,  # [max_pos, D / 2]
    sin_ptr,
    positions_ptr,  # [T] int32 or int64
    tokens,
    q_ptr,  # [T, Hq * D]
    k_ptr,  # [T, Hkv * D]
    v_ptr,  # [T, Hkv * D]
    EPS: tl.constexpr, HIDDEN: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HEAD_DIM // 2
    WIDTH: tl.constexpr = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    x_rows = x_ptr + row_offsets(rows, HIDDEN)
    ks = tl.arange(0, BLOCK_K)

    # Pass 1: RMS of each row (float32).
    squares = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        x = tl.load(x_rows[:, None] + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & ((k0 + ks) < HIDDEN)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        squares += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(squares / HIDDEN + EPS)

    # Pass 2: normalized rows times the tile's low and high rotary columns.
    pairs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_ok = pairs < WIDTH // 2
    head = pairs // HALF
    half = pairs % HALF
    col_lo = head * HEAD_DIM + half
    acc_lo = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)
    acc_hi = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = (k0 + ks) < HIDDEN
        x = tl.load(x_rows[:, None] + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        g = tl.load(norm_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        xn = (x * rstd[:, None] * g[None, :]).to(w_ptr.dtype.element_ty)
        w_rows = (k0 + ks)[:, None] * WIDTH
        w_mask = k_ok[:, None] & pair_ok[None, :]
        acc_lo += dot(xn, tl.load(w_ptr + w_rows + col_lo[None, :], mask=w_mask, other=0.0))
        acc_hi += dot(xn, tl.load(w_ptr + w_rows + (col_lo + HALF)[None, :], mask=w_mask, other=0.0))
    if HAS_BIAS:
        acc_lo += tl.load(bias_ptr + col_lo, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        acc_hi += tl.load(bias_ptr + col_lo + HALF, mask=pair_ok, other=0.0).to(tl.float32)[None, :]

    # RoPE on Q and K pairs (rotate-half); V pairs pass through.
    rotate = (head < NUM_Q_HEADS + NUM_KV_HEADS)[None, :]
    pos = tl.load(positions_ptr + rows, mask=row_ok, other=0)
    trig = pos.to(tl.int64)[:, None] * HALF + half[None, :]
    cos = tl.where(rotate, tl.load(cos_ptr + trig, mask=row_ok[:, None], other=1.0).to(tl.float32), 1.0)
    sin = tl.where(rotate, tl.load(sin_ptr + trig, mask=row_ok[:, None], other=0.0).to(tl.float32), 0.0)
    lo = acc_lo * cos - acc_hi * sin
    hi = acc_hi * cos + acc_lo * sin

    # One store per half: each column goes to q, k or v at its place in that output.
    is_q = head < NUM_Q_HEADS
    is_k = (head >= NUM_Q_HEADS) & (head < NUM_Q_HEADS + NUM_KV_HEADS)
    out_col = (head - tl.where(is_q, 0, tl.where(is_k, NUM_Q_HEADS, NUM_Q_HEADS + NUM_KV_HEADS))) * HEAD_DIM + half
    width = tl.where(is_q, NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM)
    offsets = row_offsets(rows, 1)[:, None] * width[None, :] + out_col[None, :]
    base = tl.where(is_q, q_ptr, tl.where(is_k, k_ptr, v_ptr))[None, :] + offsets
    mask = row_ok[:, None] & pair_ok[None, :]
    tl.store(base, lo.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, hi.to(q_ptr.dtype.element_ty), mask=mask)


def check_head_dim(head_dim: int) -> None:
    if head_dim // 2 < MIN_DOT or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= {2 * MIN_DOT} (got {head_dim})")


def grid(tokens: int, heads: int, head_dim: int, tiles: PrologueTiles) -> tuple[int, int]:
    return triton.cdiv(tokens, tiles.block_t), triton.cdiv(heads * head_dim // 2, tiles.block_p)


def fused_rmsnorm_qkv_rope(x, norm_weight, w_qkv, bias, cos, sin, positions, num_q_heads, num_kv_heads, eps,
                           tactic: str | None = None):  # fmt: skip
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); returns q [T, Hq*D],
    k and v [T, Hkv*D], as the plugin. `tactic`: "decode" / "prefill" (the fused kernel's tiles)
    or "gemm" (prologue_gemm.py); default `default_tactic(tokens)`."""
    import torch

    tokens, hidden = x.shape
    heads = num_q_heads + 2 * num_kv_heads
    head_dim = w_qkv.shape[1] // heads
    check_head_dim(head_dim)
    tactic = tactic or default_tactic(tokens)
    if tactic == "gemm":
        from plugins_cuda.prologue_gemm import rmsnorm_gemm_rope

        return rmsnorm_gemm_rope(x, norm_weight, w_qkv, bias, cos, sin, positions, num_q_heads, num_kv_heads, eps)
    tiles = tiles_for(tactic, w_qkv.element_size())
    q, k, v = (torch.empty((tokens, n * head_dim), dtype=x.dtype, device=x.device)
               for n in (num_q_heads, num_kv_heads, num_kv_heads))  # fmt: skip
    fused_rmsnorm_qkv_rope_kernel[grid(tokens, heads, head_dim, tiles)](
        x, norm_weight, w_qkv, bias if bias is not None else w_qkv, cos, sin, positions, tokens, q, k, v,
        EPS=eps, HIDDEN=hidden, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_T=tiles.block_t, BLOCK_P=tiles.block_p, BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return q, k, v


def compile_for_arch(arch: int, dtype: str, hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     has_bias: bool = False, eps: float = 1e-5, positions: str = "*i32", cos_sin: str = "*fp32",
                     tactic: str = "decode"):  # fmt: skip
    """AOT-compile for one GPU architecture (80, 89, 90); needs no GPU. The plugin passes
    int64 positions and cos/sin in the model dtype (`positions="*i64"`, `cos_sin=pointer`)."""
    pointer = triton_pointer(dtype)
    tiles = tiles_for(tactic, 4 if dtype == "float32" else 2)
    signature = {
        "x_ptr": pointer, "norm_ptr": pointer, "w_ptr": pointer, "bias_ptr": pointer,
        "cos_ptr": cos_sin, "sin_ptr": cos_sin, "positions_ptr": positions, "tokens": "i32",
        "q_ptr": pointer, "k_ptr": pointer, "v_ptr": pointer, "EPS": "constexpr", "HIDDEN": "constexpr",
        "NUM_Q_HEADS": "constexpr", "NUM_KV_HEADS": "constexpr", "HEAD_DIM": "constexpr",
        "BLOCK_T": "constexpr", "BLOCK_P": "constexpr", "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr",
    }  # fmt: skip
    constexprs = {
        "EPS": eps, "HIDDEN": hidden, "NUM_Q_HEADS": num_q_heads, "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim,
        "BLOCK_T": tiles.block_t, "BLOCK_P": tiles.block_p, "BLOCK_K": tiles.block_k, "HAS_BIAS": has_bias,
    }  # fmt: skip
    return compile_kernel(fused_rmsnorm_qkv_rope_kernel, signature, constexprs, arch,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip

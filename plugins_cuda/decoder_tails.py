"""The decoder layer's elementwise tails, each one kernel: the residual add with the RMSNorm after it (before
attention and before the MLP), and SwiGLU's SiLU(gate) * up.

In torch these are ~8 and 2 small kernels per layer (HF's `rms_norm`: cast, square, mean, rsqrt, scale,
cast, weight; `F.silu(gate) * up`), each a launch and a pass over the rows. A decode step of a small model
is mostly such launches (benchmarks/results/gpu-h100-2026-11-26: 1.56 ms a step for SmolLM2-135M at one
sequence), so per layer these two save ~9 of ~19 launches. The roundings are HF eager's in the compute
dtype: the residual sum rounded once, the normalized row rounded before the weight multiplies it, SiLU
rounded before the product. Rows are tiled (BLOCK_T per program) so that a decode's few rows are one
program and the interpreter (CPU) runs few programs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins_cuda.common import row_offsets, step_kernel

TILE_ELEMENTS = 4096  # a program's tile, rows x columns: few registers a thread at 4 warps
MAX_BLOCK_T = 16


@step_kernel
def add_rms_norm_kernel(
    hidden_ptr, delta_ptr, norm_ptr, sum_ptr, out_ptr, tokens,
    EPS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DELTA: tl.constexpr,
):  # fmt: skip
    """sum = hidden + delta (the residual stream); out = RMSNorm(sum) * g, for BLOCK_T rows. Without a
    delta (the first layer's norm): out = RMSNorm(hidden) * g, and sum is not written."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    ok = (rows < tokens)[:, None] & (cols < HIDDEN)[None, :]
    offsets = row_offsets(rows, HIDDEN)[:, None] + cols[None, :]
    x = tl.load(hidden_ptr + offsets, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + offsets, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offsets, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HIDDEN + EPS)
    normed = (xf * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    g = tl.load(norm_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (normed * g[None, :]).to(out_ptr.dtype.element_ty), mask=ok)


@step_kernel
def silu_mul_kernel(
    gate_up_ptr, out_ptr, tokens, INTER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    """out = SiLU(gate) * up for a tile, where a row of gate_up is [gate | up], INTER wide each."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows < tokens)[:, None] & (cols < INTER)[None, :]
    src = gate_up_ptr + row_offsets(rows, 2 * INTER)[:, None] + cols[None, :]
    gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(src + INTER, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    dst = out_ptr + row_offsets(rows, INTER)[:, None] + cols[None, :]
    tl.store(dst, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def _rows_per_program(columns: int) -> int:
    return max(1, min(MAX_BLOCK_T, TILE_ELEMENTS // columns))


def add_rms_norm(hidden, delta, norm_weight, eps: float):
    """(hidden + delta, RMSNorm(hidden + delta) * norm_weight), both [T, H] in hidden's dtype; delta None:
    (hidden, RMSNorm(hidden) * norm_weight)."""
    import torch

    tokens, width = hidden.shape
    block_h = triton.next_power_of_2(width)
    block_t = _rows_per_program(block_h)
    hidden = hidden.contiguous()
    total = hidden if delta is None else torch.empty_like(hidden)
    normed = torch.empty_like(hidden)
    add_rms_norm_kernel[(triton.cdiv(tokens, block_t),)](
        hidden, hidden if delta is None else delta.contiguous(), norm_weight, total, normed, tokens,
        EPS=eps, HIDDEN=width, BLOCK_T=block_t, BLOCK_H=block_h, HAS_DELTA=delta is not None,
        num_warps=8 if block_h >= 4096 else 4,
    )  # fmt: skip
    return total, normed


def silu_mul(gate_up):
    """SiLU(gate) * up of gate_up [T, 2I] = [gate | up]: [T, I]."""
    import torch

    tokens, width = gate_up.shape
    inter = width // 2
    block_i = min(1024, triton.next_power_of_2(inter))
    block_t = _rows_per_program(block_i)
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    silu_mul_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(inter, block_i))](
        gate_up.contiguous(), out, tokens, INTER=inter, BLOCK_T=block_t, BLOCK_I=block_i, num_warps=4
    )
    return out

"""The cpu-bf16 backend's per-layer glue, in the kernel module (executors/kernels/layer_ops.h):
RMSNorm over bfloat16 rows, and RoPE + the split of a fused QKV row into float32 q, k, v. Each replaces
8-10 small torch ops per call; torch.rms_norm / the torch RoPE stay the reference (tests)."""

from __future__ import annotations

import numpy as np
import torch

from executors.cpu_attention import kernel_module

_kernel = kernel_module()


def _check(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, got {tensor.dtype} {tuple(tensor.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm of bfloat16 rows [T, H]: normalized in float32, rounded, scaled by `weight` [H]."""
    _check(x, torch.bfloat16, "x")
    _check(weight, torch.bfloat16, "weight")
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    out = torch.empty_like(x)
    _kernel.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rope_split(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Fused QKV rows [T, (heads + 2 kv_heads) D] bfloat16 -> float32 q [T, heads D] and k [T, kv_heads D]
    rotated at `positions` [T], and v [T, kv_heads D]. cos, sin: float32 [max_positions, D] tables of the
    rotate-half form (x * cos + [x2, x1] * sin; sin's first half negated)."""
    _check(qkv, torch.bfloat16, "qkv")
    for table, name in ((cos, "cos"), (sin, "sin")):
        _check(table, torch.float32, name)
    tokens, head_dim = qkv.shape[0], cos.shape[1]
    if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or sin.shape != cos.shape:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match {heads} + 2 x {kv_heads} heads of {head_dim}")
    pos = np.ascontiguousarray(positions, np.int64)
    if pos.shape != (tokens,) or (tokens and (pos.min() < 0 or pos.max() >= cos.shape[0])):
        raise ValueError(f"positions must be [{tokens}] in [0, {cos.shape[0]})")
    q = np.empty((tokens, heads * head_dim), np.float32)
    k = np.empty((tokens, kv_heads * head_dim), np.float32)
    v = np.empty_like(k)
    _kernel.rope_split_bf16(qkv.data_ptr(), tokens, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                            pos.ctypes.data, q.ctypes.data, k.ctypes.data, v.ctypes.data)  # fmt: skip
    return q, k, v

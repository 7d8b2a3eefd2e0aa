"""Encoding K/V rows for a quantized pool (the formats: engine_format/kv_cache.py).

The CPU backends quantize here, as rows are written (the paged-attention kernel only reads);
the kernel dequantizes the same way (executors/kernels/paged_attention.c).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine_format.kv_cache import FP8_E4M3_MAX, INT8_MAX


def quantize_int8(rows: np.ndarray, kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """rows [T, kv_heads*head_dim] float -> (int8 [T, kv_heads*head_dim], float32 scales [T, kv_heads]),
    symmetric per (token, kv head): scale = absmax / 127."""
    heads = rows.reshape(rows.shape[0], kv_heads, -1).astype(np.float32, copy=False)
    absmax = np.abs(heads).max(-1)
    scales = (absmax / INT8_MAX).astype(np.float32)
    inverse = np.divide(np.float32(INT8_MAX), absmax, out=np.zeros_like(absmax), where=absmax > 0)  # all-zero: 0
    codes = np.clip(np.rint(heads * inverse[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes.reshape(rows.shape), scales


def dequantize_int8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of quantize_int8: codes [..., kv_heads*head_dim], scales [..., kv_heads]."""
    kv_heads = scales.shape[-1]
    heads = codes.reshape(*codes.shape[:-1], kv_heads, -1).astype(np.float32) * scales[..., None]
    return heads.reshape(codes.shape)


def encode_fp8(values: np.ndarray, scale: float) -> np.ndarray:
    """values / scale as E4M3 (fn) bit patterns (uint8), round to nearest even, saturated at +-448
    (a plain cast of a larger value gives NaN)."""
    scaled = np.clip(np.asarray(values, np.float32) / np.float32(scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def decode_fp8(bits: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale)


@dataclass(frozen=True)
class KVQuant:
    """How one layer's quantized pool is read (engine_format/kv_cache.py): "int8" with row scales
    k_scales/v_scales [num_blocks, block_size, kv_heads] float32, or "fp8" (E4M3 bits) with the
    layer's static k_scale/v_scale."""

    kind: str
    k_scales: np.ndarray | None = None
    v_scales: np.ndarray | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def check(self, cache_shape: tuple[int, ...], kv_heads: int) -> None:
        if self.kind not in ("int8", "fp8"):
            raise ValueError(f"KVQuant.kind must be int8 or fp8 (got {self.kind!r})")
        if self.kind == "int8":
            want = (*cache_shape[:2], kv_heads)
            for s in (self.k_scales, self.v_scales):
                if s is None or s.dtype != np.float32 or s.shape != want or not s.flags.c_contiguous:
                    raise ValueError(f"int8 scales must be C-contiguous float32 {want}")

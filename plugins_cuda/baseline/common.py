"""Jitted helpers every kernel shares: 64-bit address arithmetic and the tl.dot precision rule.

Offsets that multiply a row count by a row width are computed in int64: batch * step rows of
a 4096-wide q pass 2^31 elements at 524,288 rows, and a pool of 100k blocks * 64 slots * 1024
columns passes it too; Triton's default int32 would wrap silently. Tested directly with huge
strides (tests/test_triton_kernels.py), no memory behind them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_offsets(rows, width):
    """Element offset of `rows` in a row-major matrix `width` elements wide, in int64."""
    return rows.to(tl.int64) * width


@triton.jit
def slot_offsets(blocks, in_block, BLOCK_SIZE: tl.constexpr, width):
    """Element offset of pool slot `blocks * BLOCK_SIZE + in_block` (rows `width` wide), in int64."""
    return (blocks.to(tl.int64) * BLOCK_SIZE + in_block) * width


@triton.jit
def dot(a, b):
    """tl.dot with fp32 accumulation; float32 operands (the verification builds) multiply in
    IEEE fp32, not TF32, so they match a float64 reference to ~1e-6."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)

"""Jitted helpers every kernel shares: 64-bit address arithmetic and the tl.dot precision rule.

Offsets that multiply a row count by a row width are computed in int64: batch * step rows of
a 4096-wide q pass 2^31 elements at 524,288 rows, and a pool of 100k blocks * 64 slots * 1024
columns passes it too; Triton's default int32 would wrap silently. Tested directly with huge
strides (tests/test_triton_kernels.py), no memory behind them.
"""

from __future__ import annotations

import triton
import triton.language as tl

# What changes from one torch-backend step to the next: its sizes (rows, block-table width, splits, tokens)
# and the index arrays it views in one packed step buffer (their 16-byte alignment follows the token
# count). Triton compiles a variant per divisibility of each (a size of 1 or a multiple of 16, an aligned
# pointer), so a step kernel is not specialized on them: one launch of each step class then stands for
# all, and the backend's warm-up compiles every variant before serving (executors/torch/backend.py
# `warm_up_steps`; checked in tests/test_warm_up_coverage.py). Sizes and index loads gain nothing from it.
STEP_SIZES = ("max_rows", "table_width", "splits", "step", "tokens")
STEP_ARRAYS = ("block_tables_ptr", "positions_ptr", "query_start_ptr", "seq_lens_ptr")


def step_kernel(fn):
    """`triton.jit` for a kernel the torch backend launches every step (STEP_SIZES, STEP_ARRAYS)."""
    return triton.jit(fn, do_not_specialize=STEP_SIZES, do_not_specialize_on_alignment=STEP_ARRAYS)


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

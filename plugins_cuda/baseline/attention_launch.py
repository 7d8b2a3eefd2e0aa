"""How the paged-attention kernels are launched: tile sizes, the split-KV heuristic, the torch
launchers (CUDA, or CPU under TRITON_INTERPRET=1) and the AOT signatures the plugins compile.

Split-KV heuristic (decode-path launches only; prefill tiles already give enough programs):
    splits = min(MAX_SPLITS, target // (batch * kv_heads), ceil(context / MIN_SPLIT_KEYS)), >= 1
with target = PROGRAMS_PER_SM * SM count (capped at SPLIT_SLOTS) and context the step's
longest sequence (block-table width * block size). Few long sequences get many programs;
a large batch, or short contexts, none. Written once over an arithmetic namespace so that
the same formula runs on ints (torch launchers, tests) and on TensorRT shape expressions
(plugins_cuda/trt_plugins.py), and the kernel never needs to recompute it: `splits` is a
launch argument. The split workspace is never larger than SPLIT_SLOTS parts, so its shape
is a constant (the plugin's second output).
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import triton

from plugins_cuda.baseline import paged_attention as kernels
from plugins_cuda.baseline.aot import compile_kernel, triton_pointer

MIN_DOT = 16  # tl.dot needs every dimension >= 16
MAX_SPLITS = 64
MIN_SPLIT_KEYS = 256  # a part below this reads too little K/V to pay for its partial write
PROGRAMS_PER_SM = 4
SPLIT_SLOTS = 1024  # >= PROGRAMS_PER_SM * SMs of any current GPU
DEFAULT_SMS = 132  # H100/H200 SXM, when no GPU says otherwise (interpreter, `trtserve kernels`)

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
INTS = SimpleNamespace(max=builtins.max, min=builtins.min, cdiv=triton.cdiv,
                       less=lambda a, b: int(a < b), const=lambda value, like: value)  # fmt: skip


@dataclass(frozen=True)
class AttentionTiles:
    """Compile-time tile sizes for one (group, head_dim, element size). float32 (the verification
    builds) multiplies in IEEE fp32 on the FMA units, whose operands live in registers: its
    tiles are smaller (ptxas still spills ~0.5 KB a thread at head_dim 128 on sm_89/90)."""

    group: int
    head_dim: int
    element_bytes: int = 2
    num_stages: int = 2

    @property
    def decode_m(self) -> int:  # the smallest tl.dot M holding a whole group
        return max(MIN_DOT, triton.next_power_of_2(self.group))

    @property
    def decode_rows(self) -> int:  # tokens per sequence the decode path takes (1 + drafts)
        return self.decode_m // self.group

    @property
    def prefill_m(self) -> int:
        return max(64 if self.element_bytes == 2 else 32, triton.next_power_of_2(self.group))

    @property
    def prefill_rows(self) -> int:
        return self.prefill_m // self.group

    @property
    def block_n(self) -> int:
        return 64 if self.element_bytes == 2 else 16

    @property
    def num_warps(self) -> int:  # 4 warps at head_dim 128 need 255 registers and spill
        return 8 if self.head_dim >= 128 and self.element_bytes == 2 else 4

    @property
    def slot_width(self) -> int:  # floats per split part: o [DECODE_M, D] then lse [DECODE_M]
        return self.decode_m * (self.head_dim + 1)

    def constexprs(self) -> dict[str, int]:
        return {"DECODE_M": self.decode_m, "PREFILL_M": self.prefill_m, "BLOCK_N": self.block_n}


def split_target(sm_count: int) -> int:
    return min(SPLIT_SLOTS, PROGRAMS_PER_SM * sm_count)


def num_splits(batch, step, table_width, block_size: int, num_kv_heads: int, tiles: AttentionTiles,
               sm_count: int, ops: Any = INTS):  # fmt: skip
    """KV splits of a launch; `batch`, `step`, `table_width` are ints or shape expressions
    (then `ops` supplies max/min/cdiv/less/const over them, with an expression always on the left)."""
    lanes = batch * num_kv_heads
    by_sms = ops.max(ops.const(split_target(sm_count), lanes) // lanes, 1)
    by_context = ops.cdiv(table_width * block_size, MIN_SPLIT_KEYS)
    splits = ops.min(ops.min(by_sms, by_context), MAX_SPLITS)
    decode = ops.less(step, tiles.decode_rows + 1)
    return decode * (splits - 1) + 1


def work_items(step, splits, tiles: AttentionTiles, ops: Any = INTS):
    """Grid x: the split count on the decode path (one tile), the query tiles otherwise (1 split)."""
    return splits * ops.cdiv(step, tiles.prefill_rows)


def sm_count_of(device) -> int:
    import torch

    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _constexprs(scale: float, window: int, num_kv_heads: int, tiles: AttentionTiles, block_size: int) -> dict:
    return {"SCALE": float(scale), "WINDOW": int(window), "NUM_KV_HEADS": num_kv_heads, "GROUP": tiles.group,
            "HEAD_DIM": tiles.head_dim, "BLOCK_SIZE": block_size, **tiles.constexprs()}  # fmt: skip


def _shape(q_width: int, k_cache, num_kv_heads: int, element_size: int | None = None) -> tuple[AttentionTiles, int]:
    """Tiles and block size; element_size: the compute dtype's (default the cache's; a quantized
    cache's codes are narrower than the q/K/V tiles the kernel computes in)."""
    block_size, kv_width = k_cache.shape[1], k_cache.shape[2]
    head_dim = kv_width // num_kv_heads
    if head_dim < MIN_DOT or head_dim & (head_dim - 1) or q_width % kv_width:
        raise ValueError(f"head_dim must be a power of two >= {MIN_DOT} and q a multiple of kv (got {head_dim})")
    return AttentionTiles(q_width // kv_width, head_dim, element_size or k_cache.element_size()), block_size


def ragged_layout(seq_of_token) -> tuple:
    """(query_start [B + 1] int32, max rows per sequence) of flat tokens; checks that each
    sequence's tokens are contiguous rows, sequences in block-table order. Host-side, once a step."""
    import torch

    seqs = seq_of_token.to(torch.int64).cpu()
    batch = int(seqs.max()) + 1 if len(seqs) else 0
    counts = torch.bincount(seqs, minlength=batch)
    if not torch.equal(seqs, torch.repeat_interleave(torch.arange(batch), counts)):
        raise ValueError("the tokens of a sequence must be contiguous rows, sequences in table order")
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    return query_start.to(seq_of_token.device), int(counts.max()) if batch else 0


def paged_attention(q, k_cache, v_cache, block_tables, seq_of_token, positions, num_kv_heads: int,
                    window: int = 0, scale: float | None = None, sm_count: int | None = None):  # fmt: skip
    """Flat ragged tokens q [T, Hq*D]; a sequence's tokens must be contiguous rows at consecutive
    positions (the segment layout). Returns [T, Hq*D]."""
    query_start, max_rows = ragged_layout(seq_of_token)
    return launch_ragged(q, k_cache, v_cache, block_tables, positions, query_start, max_rows, num_kv_heads,
                         window=window, scale=scale, sm_count=sm_count)  # fmt: skip


def launch_ragged(q, k_cache, v_cache, block_tables, positions, query_start, max_rows: int, num_kv_heads: int,
                  window: int = 0, scale: float | None = None, sm_count: int | None = None):  # fmt: skip
    """paged_attention with its layout already known (no host synchronization: graph-capturable)."""
    import torch

    tiles, block_size = _shape(q.shape[1], k_cache, num_kv_heads)
    batch = query_start.shape[0] - 1
    out = torch.empty_like(q)
    if not batch:
        return out
    tables = block_tables[:batch].to(torch.int64).contiguous()
    splits = num_splits(batch, max_rows, tables.shape[1], block_size, num_kv_heads, tiles,
                        sm_count or sm_count_of(q.device))  # fmt: skip
    partials = torch.empty((batch * num_kv_heads * splits, tiles.slot_width), dtype=torch.float32, device=q.device)
    scale = tiles.head_dim**-0.5 if scale is None else scale
    grid = (work_items(max_rows, splits, tiles), num_kv_heads, batch)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    kernels.paged_attention_ragged_kernel[grid](
        q.contiguous(), k_cache, v_cache, tables, positions.to(torch.int64).contiguous(), query_start,
        max_rows, tables.shape[1], splits, out, partials,
        **_constexprs(scale, window, num_kv_heads, tiles, block_size), **launch,
    )  # fmt: skip
    if splits > 1:
        kernels.paged_attention_ragged_merge_kernel[(1, num_kv_heads, batch)](
            partials, query_start, max_rows, splits, out, NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group,
            HEAD_DIM=tiles.head_dim, DECODE_M=tiles.decode_m, **launch,
        )  # fmt: skip
    return out


def paged_attention_padded(q, k_cache, v_cache, block_tables, positions, num_kv_heads: int, scale: float,
                           window: int = 0, sm_count: int = DEFAULT_SMS):  # fmt: skip
    """Both plugin kernels as TensorRT launches them: q [B, S, Hq*D], positions [B, S] (padding
    repeats the last position); returns [B, S, Hq*D], zeros in padding rows."""
    import torch

    batch, step, width = q.shape
    tiles, block_size = _shape(width, k_cache, num_kv_heads)
    tables = block_tables.to(torch.int64).contiguous()
    splits = num_splits(batch, step, tables.shape[1], block_size, num_kv_heads, tiles, sm_count)
    partials = torch.empty((SPLIT_SLOTS, tiles.slot_width), dtype=torch.float32, device=q.device)
    positions = positions.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    kernels.paged_attention_kernel[(work_items(step, splits, tiles), num_kv_heads, batch)](
        q.contiguous(), k_cache, v_cache, tables, positions, step, tables.shape[1], splits, out, partials,
        **_constexprs(scale, window, num_kv_heads, tiles, block_size), **launch,
    )  # fmt: skip
    kernels.paged_attention_merge_kernel[(1, num_kv_heads, batch)](
        out, partials, tables, positions, step, splits, out,
        NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group, HEAD_DIM=tiles.head_dim, DECODE_M=tiles.decode_m, **launch,
    )  # fmt: skip
    return out


def attention_signature(dtype: str) -> dict[str, str]:
    """The plugin entry's parameters, in TensorRT's AOT order."""
    pointer = triton_pointer(dtype)
    names = ("SCALE", "WINDOW", "NUM_KV_HEADS", "GROUP", "HEAD_DIM", "BLOCK_SIZE", "DECODE_M", "PREFILL_M", "BLOCK_N")
    return {
        "q_ptr": pointer, "k_cache_ptr": pointer, "v_cache_ptr": pointer, "block_tables_ptr": "*i64",
        "positions_ptr": "*i64", "step": "i32", "table_width": "i32", "splits": "i32", "out_ptr": pointer,
        "partials_ptr": "*fp32", **dict.fromkeys(names, "constexpr"),
    }  # fmt: skip


def merge_signature(dtype: str) -> dict[str, str]:
    pointer = triton_pointer(dtype)
    return {
        "ctx_ptr": pointer, "partials_ptr": "*fp32", "block_tables_ptr": "*i64", "positions_ptr": "*i64",
        "step": "i32", "splits": "i32", "out_ptr": pointer,
        **dict.fromkeys(("NUM_KV_HEADS", "GROUP", "HEAD_DIM", "DECODE_M"), "constexpr"),
    }  # fmt: skip


def compile_attention(arch: int, dtype: str, num_kv_heads: int, group: int, head_dim: int, block_size: int,
                      scale: float, window: int = 0):  # fmt: skip
    """AOT-compile `trtserve::PagedAttention`'s kernel for one architecture; needs no GPU."""
    tiles = AttentionTiles(group, head_dim, ELEMENT_BYTES[dtype])
    return compile_kernel(kernels.paged_attention_kernel, attention_signature(dtype),
                          _constexprs(scale, window, num_kv_heads, tiles, block_size), arch,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip


def compile_merge(arch: int, dtype: str, num_kv_heads: int, group: int, head_dim: int):
    """AOT-compile `trtserve::PagedAttentionMerge`'s kernel for one architecture; needs no GPU."""
    tiles = AttentionTiles(group, head_dim)
    constexprs = {"NUM_KV_HEADS": num_kv_heads, "GROUP": group, "HEAD_DIM": head_dim, "DECODE_M": tiles.decode_m}
    return compile_kernel(kernels.paged_attention_merge_kernel, merge_signature(dtype), constexprs, arch,
                          num_warps=tiles.num_warps)  # fmt: skip

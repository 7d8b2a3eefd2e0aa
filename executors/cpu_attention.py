"""Python entry to the CPU paged-attention kernel (executors/kernels/paged_attention.c)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from executors.cpus import libgomp_loaded, usable_cpus
from executors.kv_quant import KVQuant

log = logging.getLogger(__name__)


# The kernel's OpenMP threads must sleep, not spin, between calls: ONNX Runtime needs the same
# cores in between (spinning cost 18% of throughput at 32 concurrent requests through Triton:
# 67 vs 82 tok/s). libgomp reads the policy once, when it is first loaded, by whichever
# library loads it first (torch ships one too), so it must be set before that.
_policy_before = os.environ.get("OMP_WAIT_POLICY")
if (_policy_before or "").upper() != "PASSIVE" and libgomp_loaded():
    log.warning(
        "libgomp was loaded (by torch?) before trtserve's attention kernel with OMP_WAIT_POLICY=%s, so "
        "its threads will spin between calls and slow the engine; export OMP_WAIT_POLICY=PASSIVE or "
        "create the engine before importing torch",
        _policy_before or "unset",
    )
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import executors._paged_attention as _paged_attention  # noqa: E402 - after the policy is set

KERNEL_ABI = 9  # the call interface this file speaks (the C module's ABI constant)
if getattr(_paged_attention, "ABI", 1) != KERNEL_ABI:
    raise ImportError(
        f"{_paged_attention.__file__} is a stale build of executors/kernels/paged_attention.c "
        f"(ABI {getattr(_paged_attention, 'ABI', 1)}, need {KERNEL_ABI}); rebuild it: "
        "`pip install -e .` or `python -c 'import setuptools; setuptools.setup()' build_ext --inplace`"
    )


def kernel_module() -> ModuleType:
    """The C module, loaded under the OpenMP policy above and its ABI checked (layer_ops.py calls it too)."""
    return _paged_attention


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


KV_KINDS = {None: 0, "int8": 1, "fp8": 2}  # the kernel's kv_kind codes
CACHE_DTYPES = {None: np.float32, "int8": np.int8, "fp8": np.uint8}


def paged_attention(
    q: np.ndarray,  # [T, Hq*D] float32
    k_cache: np.ndarray,  # [num_blocks, block_size, Hkv*D] float32, C-contiguous
    v_cache: np.ndarray,
    block_tables: np.ndarray,  # [B, M] int64
    seq_of_token: np.ndarray,  # [T] int64: row of block_tables for each query token
    positions: np.ndarray,  # [T] int64: the query's position; keys 0..position are attended
    shape: AttentionShape,
    window: int | None = None,
    out: np.ndarray | None = None,
    threads: int | None = None,
    quant: KVQuant | None = None,
    simd: bool = True,
    amx: bool = True,
) -> np.ndarray:
    """Attention of each query token over its sequence's cached keys, read in place. `quant`: the
    caches hold int8 or fp8 codes (None: float32). `simd=False`: the kernel's portable loops instead
    of its AVX-512 ones (where it has them; tests compare the two). `amx=False`: int8 tiles of several
    tokens stay on the vector loops instead of AMX tile products (where usable: amx_available())."""
    tokens = q.shape[0]
    width = shape.num_heads * shape.head_dim
    if q.dtype != np.float32 or q.shape != (tokens, width) or not q.flags.c_contiguous:
        raise ValueError(f"q must be C-contiguous float32 [tokens, {width}], got {q.dtype} {q.shape}")
    kind = quant.kind if quant else None
    cache_dtype = np.dtype(CACHE_DTYPES.get(kind, np.float32))
    for cache in (k_cache, v_cache):
        if cache.dtype != cache_dtype or not cache.flags.c_contiguous or cache.shape[1] != shape.block_size:
            raise ValueError(f"k/v cache must be C-contiguous {cache_dtype} [num_blocks, block_size, kv_width]")
    if quant:
        quant.check(k_cache.shape, shape.num_kv_heads)
    k_scales = quant.k_scales.ctypes.data if quant and quant.k_scales is not None else 0
    v_scales = quant.v_scales.ctypes.data if quant and quant.v_scales is not None else 0
    tables = np.ascontiguousarray(block_tables, np.int64)
    seqs = np.ascontiguousarray(seq_of_token, np.int64)
    pos = np.ascontiguousarray(positions, np.int64)
    if out is None:
        out = np.empty_like(q)
    _paged_attention.paged_attention(
        q.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data, out.ctypes.data,
        tables.ctypes.data, seqs.ctypes.data, pos.ctypes.data,
        tokens, tables.shape[1], shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size,
        window or 0, shape.head_dim**-0.5, threads or usable_cpus(),
        KV_KINDS[kind], k_scales, v_scales, quant.k_scale if quant else 1.0, quant.v_scale if quant else 1.0, simd,
        amx,
    )  # fmt: skip
    return out


def amx_available() -> bool:
    """Whether the kernel runs int8 attention tiles on AMX here (built with AMX-INT8 and allowed by the OS)."""
    return bool(_paged_attention.amx_available())


def write_kv(
    k: np.ndarray,  # [T, Hkv*D] float32: the step's new K rows
    v: np.ndarray,
    slots: np.ndarray,  # [T] int64: pool row (block * block_size + offset) of each
    k_pool: np.ndarray,  # [num_blocks * block_size, Hkv*D] int8 or fp8 bits (uint8), C-contiguous
    v_pool: np.ndarray,
    quant: KVQuant,  # int8: the scale pools [num_blocks * block_size, Hkv] (written too); fp8: the layer's scales
) -> None:
    """Quantize rows into a quantized pool in place, in C: the same codes and scales, bit for bit, as
    executors/kv_quant.py's quantize_int8 / encode_fp8 (the numpy reference)."""
    cache_dtype = np.dtype(CACHE_DTYPES.get(quant.kind, np.float32))
    rows, width = k.shape
    for pool in (k_pool, v_pool):
        if pool.dtype != cache_dtype or pool.ndim != 2 or pool.shape[1] != width or not pool.flags.c_contiguous:
            raise ValueError(f"pools must be C-contiguous {cache_dtype} [slots, {width}]")
    kv_heads = 0
    if quant.kind == "int8":
        for scales in (quant.k_scales, quant.v_scales):
            if scales is None or scales.dtype != np.float32 or scales.ndim != 2 or not scales.flags.c_contiguous:
                raise ValueError("int8 scales must be C-contiguous float32 [slots, kv_heads]")
            if scales.shape[0] != k_pool.shape[0] or width % scales.shape[1]:
                raise ValueError(f"int8 scales {scales.shape} do not match the pool {k_pool.shape}")
        assert quant.k_scales is not None and quant.v_scales is not None
        kv_heads = quant.k_scales.shape[1]
    elif quant.kind != "fp8":
        raise ValueError(f"KVQuant.kind must be int8 or fp8 (got {quant.kind!r})")
    k_rows = np.ascontiguousarray(k, np.float32)
    v_rows = np.ascontiguousarray(v, np.float32)
    if v_rows.shape != (rows, width):
        raise ValueError(f"k and v rows differ: {k.shape} vs {v.shape}")
    slot_ids = np.ascontiguousarray(slots, np.int64)
    if slot_ids.shape != (rows,):
        raise ValueError(f"{rows} rows need {rows} slots, got shape {slot_ids.shape}")
    _paged_attention.write_kv(
        k_rows.ctypes.data, v_rows.ctypes.data, slot_ids.ctypes.data, rows, kv_heads or 1,
        width // (kv_heads or 1), k_pool.ctypes.data, v_pool.ctypes.data, k_pool.shape[0], KV_KINDS[quant.kind],
        quant.k_scales.ctypes.data if quant.k_scales is not None else 0,
        quant.v_scales.ctypes.data if quant.v_scales is not None else 0, quant.k_scale, quant.v_scale,
    )  # fmt: skip

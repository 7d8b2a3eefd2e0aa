"""The KV cache's storage format: its dtype names, the scales of a quantized pool, bytes per token.

`kv_cache_dtype` (manifest `kv_cache.dtype`, `build-engine --kv-cache-dtype`):
- "auto": the model dtype (a float32 or float16 pool), no scales. An engine whose manifest has no
  `kv_cache` section is "auto" (engines built before KV quantization keep loading).
- "int8": symmetric int8, one float32 scale per (token, kv head) = absmax/127 of that row's head_dim
  values, computed when the row is written. No calibration is needed, and an outlier token or head
  costs precision only in its own row. Scales live in a second pool beside the data (SCALES_SHAPE).
- "fp8": E4M3 (the `fn` variant: no infinities, max 448) stored as uint8 bit patterns, with one static
  float32 scale per (layer, K|V) measured by the calibration job (absmax over the calibration text
  / 448) and recorded in the manifest (`kv_cache.scales`). Static scales keep the pool free of
  per-row scale bytes (exactly 4x fp32) and are what a GPU FP8 attention reads as one scalar.

Values are stored as round(x / scale) (int8: clipped to +-127; fp8: to +-448 first, since
casting a larger value makes NaN) and read back as stored * scale.
"""

from __future__ import annotations

from engine_format.model_spec import ModelSpec

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZED_KV_DTYPES = ("int8", "fp8")
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
# The pool's numpy dtype per kv dtype ("auto" takes the model dtype's).
POOL_DTYPES = {"int8": "int8", "fp8": "uint8"}
SCALE_DTYPE = "float32"
# int8 only: the scales pool beside the data pool [layers, 2, num_blocks, block_size, kv_width].
SCALES_SHAPE = ("num_layers", 2, "num_blocks", "block_size", "num_kv_heads")


def pool_dtype(model_dtype: str, kv_cache_dtype: str) -> str:
    """numpy dtype name of the pool's elements."""
    return POOL_DTYPES.get(kv_cache_dtype, model_dtype)


def itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}[dtype]


def bytes_per_token(spec: ModelSpec, model_dtype: str, kv_cache_dtype: str) -> int:
    """Pool bytes one token takes over all layers, K and V, scales included."""
    data = spec.kv_width * itemsize(pool_dtype(model_dtype, kv_cache_dtype))
    scales = spec.num_kv_heads * itemsize(SCALE_DTYPE) if kv_cache_dtype == "int8" else 0
    return 2 * spec.num_layers * (data + scales)


def check_kv_cache(kv_cache_dtype: str, scales: tuple[tuple[float, float], ...] | None, num_layers: int) -> str | None:
    """What is wrong with a manifest's kv_cache section, or None."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"kv_cache.dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
    if kv_cache_dtype == "fp8":
        if scales is None or len(scales) != num_layers:
            return f"an fp8 KV cache needs kv_cache.scales: one [k, v] pair per layer ({num_layers})"
        if not all(len(pair) == 2 and min(pair) > 0 for pair in scales):
            return "kv_cache.scales must be positive [k, v] pairs"
    return None

"""The KV pool memory shared by the CPU backends.

One C-contiguous allocation [layers, 2 (K, V), num_blocks, block_size, kv_width]: each
layer's K and V are contiguous views, which both ONNX Runtime (bound zero-copy) and the
paged-attention kernel read in place. A quantized pool (engine_format/kv_cache.py) holds int8
or fp8 codes; int8 has a second allocation of scales [layers, 2, num_blocks, block_size, kv_heads]
(`KVPool`), and rows are quantized as they are written.

The pool is committed at start-up: np.zeros maps pages lazily (calloc), so a pool larger than
memory used to start fine and die of an OOM kill under load, as blocks filled. Now the bytes it
needs are checked against the memory available (MemAvailable, and the cgroup's limit) first, and
every page is written once.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from engine_format import EngineConfig, EngineLoadError
from engine_format.kv_cache import bytes_per_token, pool_dtype
from executors.kv_quant import KVQuant, encode_fp8, quantize_int8

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


class PoolMemoryError(MemoryError):
    """The KV pool does not fit in the memory available: a start-up error naming both sizes."""


def available_memory() -> tuple[int, str] | None:
    """(bytes a new allocation can take, where that figure comes from), or None where unknown."""
    limits: list[tuple[int, str]] = []
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in _cgroup_files():
        try:
            limit = limit_file.read_text().strip()
            if limit != "max" and int(limit) < 2**60:  # v1 writes "no limit" as a huge number
                headroom = max(int(limit) - int(usage_file.read_text()), 0)
                limits.append((headroom, f"cgroup limit {limit_file} less usage"))
                break
        except (OSError, ValueError):
            continue
    return min(limits) if limits else None


def _cgroup_files() -> list[tuple[Path, Path]]:
    """(limit, usage) files of this process's memory cgroup, v2 then v1; inside a container the group
    is often the mount's root, so that is tried too."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    candidates = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            dirs = (CGROUP / group.lstrip("/"), CGROUP)
            candidates += [(d / "memory.max", d / "memory.current") for d in dirs]
        elif "memory" in controllers.split(","):
            dirs = (CGROUP / "memory" / group.lstrip("/"), CGROUP / "memory")
            candidates += [(d / "memory.limit_in_bytes", d / "memory.usage_in_bytes") for d in dirs]
    return candidates


# The backends that read an int8/fp8 pool (the others refuse such an engine at load, naming themselves).
KV_QUANT_BACKENDS = ("cpu", "cpu-bf16", "cpu-int8", "graph", "plugin", "torch")


def require_kv_support(config: EngineConfig, backend: str) -> None:
    """EngineLoadError unless `backend` reads the engine's KV dtype: never run a quantized pool wrong."""
    if config.kv_quantized and backend not in KV_QUANT_BACKENDS:
        raise EngineLoadError(
            f"the {backend!r} backend does not read a {config.kv_cache_dtype} KV cache (engine "
            f"{config.engine_dir} has kv_cache_dtype {config.kv_cache_dtype!r}); use backend "
            f"{' or '.join(repr(b) for b in KV_QUANT_BACKENDS)}, or rebuild with --kv-cache-dtype auto"
        )


def pool_bytes(config: EngineConfig, num_blocks: int) -> int:
    """Bytes of a pool of num_blocks blocks in the engine's KV dtype, scales included."""
    return num_blocks * config.block_size * bytes_per_token(config.model, config.dtype, config.kv_cache_dtype)


def blocks_for_budget(config: EngineConfig, budget_bytes: int) -> int:
    """The most blocks a pool in the engine's KV dtype holds within budget_bytes."""
    return budget_bytes // pool_bytes(config, 1)


def capacity_line(config: EngineConfig, num_blocks: int, float_pool: str | None = None) -> str:
    """The capacity the server logs at start: KV dtype, blocks, tokens, bytes, max concurrency.
    `float_pool`: an unquantized pool's dtype where the backend keeps another than the model's."""
    tokens = num_blocks * config.block_size
    per_token = bytes_per_token(config.model, float_pool or config.dtype, config.kv_cache_dtype)
    return (
        f"KV pool {pool_dtype(float_pool or config.dtype, config.kv_cache_dtype)} (kv_cache_dtype "
        f"{config.kv_cache_dtype}): {num_blocks} blocks x {config.block_size} tokens = {tokens} tokens, "
        f"{tokens * per_token / 2**20:.1f} MiB ({per_token} bytes/token incl. scales); "
        f"max concurrency at max_seq_len {config.max_seq_len}: {tokens / config.max_seq_len:.1f} sequences"
    )


def allocate_pool(config: EngineConfig, num_blocks: int, dtype: npt.DTypeLike, extra_bytes: int = 0) -> np.ndarray:
    """`extra_bytes`: allocated beside the pool (its scales), counted in the memory check."""
    spec = config.model
    shape = (spec.num_layers, 2, num_blocks, config.block_size, spec.kv_width)
    needed = math.prod(shape) * np.dtype(dtype).itemsize + extra_bytes
    available = available_memory()
    if available is not None and needed > available[0]:
        raise PoolMemoryError(
            f"the KV pool ({num_blocks} blocks x {config.block_size} tokens) needs {needed:,} bytes "
            f"({needed / 2**30:.2f} GiB) but only {available[0]:,} bytes ({available[0] / 2**30:.2f} GiB) "
            f"are available ({available[1]}): lower --num-kv-blocks"
        )
    pool = committed_zeros(shape, dtype)
    log.info(capacity_line(config, num_blocks, None if config.kv_quantized else np.dtype(dtype).name))
    return pool


def committed_zeros(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """Zeros whose memory is committed now, not page by page under load. The kernel maps every page at once
    (MAP_POPULATE), several times faster than touching each page from Python (numpy's fill was most of an
    engine's start: benchmarks/results/engine-start.md)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if not hasattr(mmap, "MAP_POPULATE") or nbytes == 0:  # (not Linux)
        return np.zeros(shape, dtype) if nbytes == 0 else np.full(shape, 0, dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return np.frombuffer(memory, dtype).reshape(shape)  # the array keeps the mapping alive


@dataclass(frozen=True)
class KVPool:
    """The pool in the engine's KV dtype, with its scales; `write` quantizes rows in place."""

    config: EngineConfig
    data: np.ndarray  # [layers, 2, num_blocks, block_size, kv_width], dtype config.kv_pool_dtype
    scales: np.ndarray | None  # int8: [layers, 2, num_blocks, block_size, kv_heads] float32

    @classmethod
    def allocate(cls, config: EngineConfig, num_blocks: int, float_pool: str | None = None) -> KVPool:
        """`float_pool`: an unquantized pool's dtype where the backend's attention reads another than the
        engine's (the cpu-bf16 backend keeps a bfloat16 engine's K/V in float32)."""
        spec = config.model
        scales_shape = (spec.num_layers, 2, num_blocks, config.block_size, spec.num_kv_heads)
        int8 = config.kv_cache_dtype == "int8"
        dtype = float_pool if float_pool and not config.kv_quantized else config.kv_pool_dtype
        data = allocate_pool(config, num_blocks, dtype, math.prod(scales_shape) * 4 if int8 else 0)
        scales = np.ones(scales_shape, np.float32) if int8 else None  # ones: commits the pages too
        return cls(config, data, scales)

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Rows k, v [T, kv_width] (float) into pool slots [T] of `layer`, quantized per the KV dtype:
        one C call for K and V (executors/kernels/paged_attention.c write_kv), the same bytes
        as `write_numpy` (batch 32: 15-20 vs 55-65 us per layer; numpy allocates and round-trips
        every intermediate)."""
        if not self.config.kv_quantized:
            rows = pool_rows(self.data)
            rows[2 * layer, slots] = k
            rows[2 * layer + 1, slots] = v
            return
        # Imported here: cpu_attention loads the C kernel and sets the OpenMP wait policy, which
        # importing executors (this module included) must not do for the other backends.
        from executors.cpu_attention import write_kv

        rows = pool_rows(self.data)
        if self.config.kv_cache_dtype == "int8":
            assert self.scales is not None
            scales = pool_rows(self.scales)
            quant = KVQuant("int8", scales[2 * layer], scales[2 * layer + 1])
        else:
            k_scale, v_scale = self.layer_scales(layer)
            quant = KVQuant("fp8", k_scale=k_scale, v_scale=v_scale)
        write_kv(k, v, slots, rows[2 * layer], rows[2 * layer + 1], quant)

    def write_numpy(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """`write` in numpy (executors/kv_quant.py's codecs): the reference the C write is
        tested against, bit for bit."""
        rows = pool_rows(self.data)
        kind = self.config.kv_cache_dtype
        for index, values in ((2 * layer, k), (2 * layer + 1, v)):
            if kind == "int8":
                assert self.scales is not None
                codes, scales = quantize_int8(values, self.config.model.num_kv_heads)
                rows[index, slots] = codes
                pool_rows(self.scales)[index, slots] = scales
            elif kind == "fp8":
                rows[index, slots] = encode_fp8(values, self.layer_scales(layer)[index % 2])
            else:
                rows[index, slots] = values

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """fp8: the layer's static (k_scale, v_scale)."""
        assert self.config.kv_scales is not None
        return self.config.kv_scales[layer]

    def quant(self, layer: int) -> KVQuant | None:
        """How the kernel reads `layer` (None: float32)."""
        kind = self.config.kv_cache_dtype
        if kind == "int8":
            assert self.scales is not None
            return KVQuant("int8", self.scales[layer, 0], self.scales[layer, 1])
        if kind == "fp8":
            return KVQuant("fp8", k_scale=self.layer_scales(layer)[0], v_scale=self.layer_scales(layer)[1])
        return None


def pool_rows(pool: np.ndarray) -> np.ndarray:
    """View [2*layers, num_blocks*block_size, kv_width]: row `slot` of each layer's K or V."""
    layers, _, blocks, block_size, width = pool.shape
    return pool.reshape(2 * layers, blocks * block_size, width)

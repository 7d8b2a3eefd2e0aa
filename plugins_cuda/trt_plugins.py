"""TensorRT plugins `trtserve::FusedRMSNormQKVRoPE`, `trtserve::PagedKVWrite`, `trtserve::PagedAttention`.

Registered through `tensorrt.plugin` (TensorRT >= 10.9 for AOT): a shape/dtype descriptor
(`register`), the supported type combinations (`autotune`) and an ahead-of-time
implementation (`aot_impl`) returning one Triton kernel compiled for the build GPU: its name,
its PTX (Triton's hidden scratch parameters removed, plugins_cuda/aot.py), the launch grid as
symbolic expressions of the input shapes, and the int32 extra arguments. The kernel is
embedded in the engine, so the runtime needs neither Python plugins nor Triton. The kernels
come from plugins_cuda/plugin_kernels.py, which `trtserve kernels` compiles too.

PagedKVWrite's outputs alias its pool inputs (`.aliased()`, which needs the builder preview
feature ALIASED_PLUGIN_IO_10_03): the kernel writes this step's rows into the pool in place.

`tensorrt` is imported only inside `register_plugins()`, so this module imports anywhere.
UNVERIFIED: written against the TensorRT 10.x `tensorrt.plugin` API and its samples; never run
(no GPU or TensorRT here). No `from __future__ import annotations`: tensorrt.plugin inspects
the decorated functions' annotations as objects.
"""

from plugins_cuda import plugin_kernels
from plugins_cuda.aot import current_arch
from plugins_cuda.plugin_kernels import NAMESPACE, PluginKernel

FLOATS = "FP32|FP16|BF16"  # one float type for every float I/O of a node (dependent combination)
_registered = False


def _dtype_name(trt, dtype) -> str:
    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    if dtype not in names:
        raise ValueError(f"trtserve plugins support float32/float16/bfloat16, not {dtype}")
    return names[dtype]


def _static(expr, what: str) -> int:
    if not expr.is_constant:
        raise ValueError(f"trtserve plugin: {what} must be static in the network")
    return int(expr.constant_value)


def _launch(trtp, kernel: PluginKernel, grid_x):
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y = grid_x, kernel.grid_y
    params.block_x = kernel.threads
    params.shared_mem = kernel.compiled.metadata.shared
    return params


def _result(kernel: PluginKernel, launch, extra):
    return kernel.compiled.metadata.name.encode(), kernel.ptx().encode(), launch, extra


def register_plugins() -> None:
    """Register the three plugins with TensorRT (idempotent). Raises ImportError without TensorRT."""
    global _registered
    if _registered:
        return
    import numpy as np
    import numpy.typing as npt
    import tensorrt as trt
    import tensorrt.plugin as trtp

    int64 = npt.NDArray[np.int64]

    # ---- FusedRMSNormQKVRoPE(x, norm_weight, w_qkv, bias, cos, sin, positions) -> q, k, v ----
    @trtp.register(f"{NAMESPACE}::FusedRMSNormQKVRoPE")
    def _prologue_desc(
        x: trtp.TensorDesc, norm_weight: trtp.TensorDesc, w_qkv: trtp.TensorDesc, bias: trtp.TensorDesc,
        cos: trtp.TensorDesc, sin: trtp.TensorDesc, positions: trtp.TensorDesc,
        epsilon: float, split_sizes: int64, num_heads: int, num_kv_heads: int,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:  # fmt: skip
        batch, step = x.shape_expr[0], x.shape_expr[1]
        return tuple(trtp.from_shape_expr((batch, step, int(n)), dtype=x.dtype) for n in split_sizes)

    @trtp.autotune(f"{NAMESPACE}::FusedRMSNormQKVRoPE")
    def _prologue_tune(x, norm_weight, w_qkv, bias, cos, sin, positions, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(", ".join([FLOATS] * 6 + ["INT64"] + [FLOATS] * 3))]

    @trtp.aot_impl(f"{NAMESPACE}::FusedRMSNormQKVRoPE")
    def _prologue_aot(
        x: trtp.TensorDesc, norm_weight: trtp.TensorDesc, w_qkv: trtp.TensorDesc, bias: trtp.TensorDesc,
        cos: trtp.TensorDesc, sin: trtp.TensorDesc, positions: trtp.TensorDesc,
        epsilon: float, split_sizes: int64, num_heads: int, num_kv_heads: int,
        outputs: tuple[trtp.TensorDesc], tactic: int,
    ) -> tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        head_dim = plugin_kernels.prologue_head_dim(split_sizes, num_heads, num_kv_heads)
        kernel = plugin_kernels.prologue_kernel(
            current_arch(), _dtype_name(trt, x.dtype), _static(x.shape_expr[2], "hidden size"), num_heads,
            num_kv_heads, head_dim, float(epsilon),
        )  # fmt: skip
        tokens = x.shape_expr[0] * x.shape_expr[1]
        launch = _launch(trtp, kernel, trtp.cdiv(tokens, kernel.rows_per_program))
        return _result(kernel, launch, trtp.SymIntExprs.from_tuple([trtp.SymInt32(tokens)]))

    # ---- PagedKVWrite(k, v, key_cache, value_cache, block_tables, positions, seq_lens) -> pools ----
    @trtp.register(f"{NAMESPACE}::PagedKVWrite")
    def _write_desc(
        k: trtp.TensorDesc, v: trtp.TensorDesc, key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        block_tables: trtp.TensorDesc, positions: trtp.TensorDesc, seq_lens: trtp.TensorDesc, block_size: int,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:  # fmt: skip
        return key_cache.aliased(), value_cache.aliased()

    @trtp.autotune(f"{NAMESPACE}::PagedKVWrite")
    def _write_tune(k, v, key_cache, value_cache, block_tables, positions, seq_lens, outputs) -> list:
        return [trtp.AutoTuneCombination(", ".join([FLOATS] * 4 + ["INT64"] * 3 + [FLOATS] * 2))]

    @trtp.aot_impl(f"{NAMESPACE}::PagedKVWrite")
    def _write_aot(
        k: trtp.TensorDesc, v: trtp.TensorDesc, key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        block_tables: trtp.TensorDesc, positions: trtp.TensorDesc, seq_lens: trtp.TensorDesc, block_size: int,
        outputs: tuple[trtp.TensorDesc], tactic: int,
    ) -> tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        kv_width = _static(key_cache.shape_expr[2], "KV width")
        kernel = plugin_kernels.kv_write_kernel(current_arch(), _dtype_name(trt, k.dtype), kv_width, block_size)
        step, width = positions.shape_expr[1], block_tables.shape_expr[1]
        launch = _launch(trtp, kernel, positions.shape_expr[0] * step)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(step), trtp.SymInt32(width)])
        return _result(kernel, launch, extra)

    # ---- PagedAttention(q, key_cache, value_cache, block_tables, positions) -> ctx ----
    @trtp.register(f"{NAMESPACE}::PagedAttention")
    def _attention_desc(
        q: trtp.TensorDesc, key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        block_tables: trtp.TensorDesc, positions: trtp.TensorDesc,
        cached_shape: int64, num_heads: int, num_kv_heads: int, scale: float, window: int,
    ) -> trtp.TensorDesc:  # fmt: skip
        return q.like()

    @trtp.autotune(f"{NAMESPACE}::PagedAttention")
    def _attention_tune(q, key_cache, value_cache, block_tables, positions, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(", ".join([FLOATS] * 3 + ["INT64"] * 2 + [FLOATS]))]

    @trtp.aot_impl(f"{NAMESPACE}::PagedAttention")
    def _attention_aot(
        q: trtp.TensorDesc, key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        block_tables: trtp.TensorDesc, positions: trtp.TensorDesc,
        cached_shape: int64, num_heads: int, num_kv_heads: int, scale: float, window: int,
        outputs: tuple[trtp.TensorDesc], tactic: int,
    ) -> tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        head_dim = plugin_kernels.head_dim_of(int(cached_shape[-1]), num_kv_heads, "cached_shape")
        kernel = plugin_kernels.attention_kernel(
            current_arch(), _dtype_name(trt, q.dtype), num_heads, num_kv_heads, head_dim,
            _static(key_cache.shape_expr[1], "block size"), float(scale), int(window),
        )  # fmt: skip
        step, width = positions.shape_expr[1], block_tables.shape_expr[1]
        launch = _launch(trtp, kernel, positions.shape_expr[0] * step)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(step), trtp.SymInt32(width)])
        return _result(kernel, launch, extra)

    _registered = True

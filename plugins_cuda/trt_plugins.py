"""TensorRT plugins `trtserve::FusedRMSNormQKVRoPE`, `::PagedKVWrite`, `::PagedAttention`, `::PagedAttentionMerge`.

Registered through `tensorrt.plugin` (TensorRT >= 10.9 for AOT): a shape/dtype descriptor
(`register`), the supported type combinations and tactics (`autotune`) and an ahead-of-time
implementation (`aot_impl`) returning one Triton kernel compiled for the build GPU: its name,
its PTX (Triton's hidden scratch parameters removed, plugins_cuda/aot.py), the launch grid as
symbolic expressions of the input shapes, and the int32 extra arguments. The kernel is
embedded in the engine, so the runtime needs neither Python plugins nor Triton. The kernels
come from plugins_cuda/plugin_kernels.py, which `trtserve kernels` compiles too.

PagedKVWrite's outputs alias its pool inputs and PagedAttentionMerge's output aliases its
ctx input (`.aliased()`, which needs the builder preview feature ALIASED_PLUGIN_IO_10_03):
those kernels write in place. PagedAttention's split count is one shape expression
(attention_launch.num_splits over batch, step and the block-table width, with the build
GPU's SM count), passed to both attention plugins as an int32 argument; its split
workspace is a second output of constant shape. The prologue offers two tactics (decode /
prefill tiles); TensorRT keeps the faster.

`tensorrt` is imported only inside `register_plugins()`, so this module imports anywhere.
UNVERIFIED: written against the TensorRT 10.x `tensorrt.plugin` API and its samples; never run
(no GPU or TensorRT here). No `from __future__ import annotations`: tensorrt.plugin inspects
the decorated functions' annotations as objects.
"""

from types import SimpleNamespace

from plugins_cuda import attention_launch, plugin_kernels
from plugins_cuda.aot import current_arch, current_sm_count
from plugins_cuda.plugin_kernels import NAMESPACE, PROLOGUE_TACTICS, PluginKernel

FLOATS = "FP32|FP16|BF16"  # one float type for every float I/O of a node (dependent combination)
PARTIALS = "FP32|FP32|FP32"  # the split workspace is float32 whatever the model dtype
_registered = False


def _dtype_name(trt, dtype) -> str:
    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    if dtype not in names:
        raise ValueError(f"trtserve plugins support float32/float16/bfloat16, not {dtype}")
    return names[dtype]


def _static(expr, what: str) -> int:
    if not expr.is_constant:
        raise ValueError(f"trtserve plugin: {what} must be static in the network")
    value = expr.constant_value  # a method in TensorRT 10.x's tensorrt.plugin, a property in later ones
    return int(value() if callable(value) else value)


def _launch(trtp, kernel: PluginKernel, grid_x, grid_y=1, grid_z=1):
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = grid_x, grid_y, grid_z
    params.block_x = kernel.threads
    params.shared_mem = kernel.compiled.metadata.shared
    return params


def _shape_ops(trtp) -> SimpleNamespace:
    """attention_launch's arithmetic over TensorRT shape expressions (expressions on the left)."""
    return SimpleNamespace(max=trtp.max, min=trtp.min, cdiv=trtp.cdiv, less=lambda a, b: a < b,
                           const=lambda value, like: like * 0 + value)  # fmt: skip


def _splits(trtp, tiles, block_tables, positions, block_size: int, num_kv_heads: int):
    """(batch, step, table width, split count) of an attention launch, as shape expressions."""
    batch, step, width = positions.shape_expr[0], positions.shape_expr[1], block_tables.shape_expr[1]
    splits = attention_launch.num_splits(batch, step, width, block_size, num_kv_heads, tiles, current_sm_count(),
                                         _shape_ops(trtp))  # fmt: skip
    return batch, step, width, splits


def _result(kernel: PluginKernel, launch, extra):
    return kernel.compiled.metadata.name.encode(), kernel.ptx().encode(), launch, extra


def register_plugins() -> None:
    """Register the four plugins with TensorRT (idempotent). Raises ImportError without TensorRT."""
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
        types = ", ".join([FLOATS] * 6 + ["INT64"] + [FLOATS] * 3)
        return [trtp.AutoTuneCombination(types, tactics=sorted(PROLOGUE_TACTICS))]

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
            num_kv_heads, head_dim, float(epsilon), tactic,
        )  # fmt: skip
        tokens = x.shape_expr[0] * x.shape_expr[1]
        launch = _launch(trtp, kernel, trtp.cdiv(tokens, kernel.tiles.block_t), int(kernel.grid[1]))
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

    # ---- PagedAttention(q, key_cache, value_cache, block_tables, positions) -> ctx, partials ----
    @trtp.register(f"{NAMESPACE}::PagedAttention")
    def _attention_desc(
        q: trtp.TensorDesc, key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        block_tables: trtp.TensorDesc, positions: trtp.TensorDesc,
        cached_shape: int64, num_heads: int, num_kv_heads: int, scale: float, window: int,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:  # fmt: skip
        head_dim = plugin_kernels.head_dim_of(int(cached_shape[-1]), num_kv_heads, "cached_shape")
        tiles = attention_launch.AttentionTiles(num_heads // num_kv_heads, head_dim)
        partials = trtp.from_shape_expr((attention_launch.SPLIT_SLOTS, tiles.slot_width), dtype=trt.float32)
        return q.like(), partials

    @trtp.autotune(f"{NAMESPACE}::PagedAttention")
    def _attention_tune(q, key_cache, value_cache, block_tables, positions, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(", ".join([FLOATS] * 3 + ["INT64"] * 2 + [FLOATS, PARTIALS]))]

    @trtp.aot_impl(f"{NAMESPACE}::PagedAttention")
    def _attention_aot(
        q: trtp.TensorDesc, key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
        block_tables: trtp.TensorDesc, positions: trtp.TensorDesc,
        cached_shape: int64, num_heads: int, num_kv_heads: int, scale: float, window: int,
        outputs: tuple[trtp.TensorDesc], tactic: int,
    ) -> tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        head_dim = plugin_kernels.head_dim_of(int(cached_shape[-1]), num_kv_heads, "cached_shape")
        block_size = _static(key_cache.shape_expr[1], "block size")
        kernel = plugin_kernels.attention_kernel(
            current_arch(), _dtype_name(trt, q.dtype), num_heads, num_kv_heads, head_dim, block_size, float(scale),
            int(window),
        )  # fmt: skip
        batch, step, width, splits = _splits(trtp, kernel.tiles, block_tables, positions, block_size, num_kv_heads)
        work = attention_launch.work_items(step, splits, kernel.tiles, _shape_ops(trtp))
        launch = _launch(trtp, kernel, work, num_kv_heads, batch)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(step), trtp.SymInt32(width), trtp.SymInt32(splits)])
        return _result(kernel, launch, extra)

    # ---- PagedAttentionMerge(ctx, partials, block_tables, positions) -> ctx (in place) ----
    @trtp.register(f"{NAMESPACE}::PagedAttentionMerge")
    def _merge_desc(
        ctx: trtp.TensorDesc, partials: trtp.TensorDesc, block_tables: trtp.TensorDesc, positions: trtp.TensorDesc,
        num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    ) -> trtp.TensorDesc:  # fmt: skip
        return ctx.aliased()

    @trtp.autotune(f"{NAMESPACE}::PagedAttentionMerge")
    def _merge_tune(ctx, partials, block_tables, positions, outputs) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(", ".join([FLOATS, PARTIALS, "INT64", "INT64", FLOATS]))]

    @trtp.aot_impl(f"{NAMESPACE}::PagedAttentionMerge")
    def _merge_aot(
        ctx: trtp.TensorDesc, partials: trtp.TensorDesc, block_tables: trtp.TensorDesc, positions: trtp.TensorDesc,
        num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
        outputs: tuple[trtp.TensorDesc], tactic: int,
    ) -> tuple[bytes, bytes, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        kernel = plugin_kernels.merge_kernel(current_arch(), _dtype_name(trt, ctx.dtype), num_heads, num_kv_heads,
                                             head_dim)  # fmt: skip
        batch, step, _, splits = _splits(trtp, kernel.tiles, block_tables, positions, block_size, num_kv_heads)
        launch = _launch(trtp, kernel, 1, num_kv_heads, batch)
        return _result(kernel, launch, trtp.SymIntExprs.from_tuple([trtp.SymInt32(step), trtp.SymInt32(splits)]))

    _registered = True

"""The kernel each TensorRT plugin embeds, compiled from plain static shapes, a dtype and an arch.

One place for both callers, so the PTX `trtserve kernels` writes is the PTX TensorRT embeds:
the plugins' `aot_impl`s (plugins_cuda/trt_plugins.py, shapes read from the network) and
`trtserve kernels` (plugins_cuda/cli.py, shapes from its options). Each function checks its
shapes before compiling (ShapeError names the offending parameter) and returns a
PluginKernel: the compiled kernel, the plugin's launch arguments in TensorRT's AOT order
(inputs, int32 extras, outputs) and its grid, described in words (trt_plugins.py builds the
same grid from shape expressions). Needs no GPU.

TensorRT's AOT plugins launch one kernel each, so split-KV decode attention is two plugins:
`PagedAttention` (the parts, or the whole output when the launch does not split) and
`PagedAttentionMerge` (combines the parts in place; an empty launch otherwise). One kernel
doing both would need its last program per (sequence, kv head) to learn that the others
finished, through a counter that must start at zero: AOT plugins get no zeroed workspace.
The prologue has two tactics (tile shapes), both compiled; TensorRT times them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plugins_cuda import attention_launch, fused_qkv, kv_write
from plugins_cuda.aot import DTYPES, plugin_ptx, triton_pointer

NAMESPACE = "trtserve"
PROLOGUE = f"{NAMESPACE}::FusedRMSNormQKVRoPE"
KV_WRITE = f"{NAMESPACE}::PagedKVWrite"
ATTENTION = f"{NAMESPACE}::PagedAttention"
MERGE = f"{NAMESPACE}::PagedAttentionMerge"
PROLOGUE_TACTICS = {1: "decode", 2: "prefill"}  # TensorRT tactic id -> fused_qkv.TACTICS (0 is reserved)


class ShapeError(ValueError):
    """Shapes a plugin kernel cannot take; `name` is the parameter at fault."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


@dataclass(frozen=True)
class PluginKernel:
    """One plugin's compiled kernel and how TensorRT launches it."""

    plugin: str  # "trtserve::PagedAttention"
    compiled: Any  # Triton's CompiledKernel: .asm["ptx"], .asm["cubin"], .metadata
    inputs: tuple[str, ...]  # the launch arguments, in order: inputs, int32 extras, outputs
    extras: tuple[str, ...]
    outputs: tuple[str, ...]
    grid: tuple[str, str, str]  # in words; trt_plugins.py builds it from shape expressions
    shapes: dict = field(default_factory=dict)  # the static arguments it was compiled for
    tiles: Any = None  # the tile configuration the grid depends on (fused_qkv / attention_launch)

    @property
    def plugin_params(self) -> int:
        """Parameters of the PTX entry TensorRT launches (Triton's hidden ones removed)."""
        return len(self.inputs) + len(self.extras) + len(self.outputs)

    @property
    def threads(self) -> int:
        return self.compiled.metadata.num_warps * 32

    def ptx(self) -> str:
        """The PTX exactly as the plugin embeds it (aot.plugin_ptx)."""
        return plugin_ptx(self.compiled, self.plugin_params)

    def launch_info(self) -> dict:
        meta = self.compiled.metadata
        return {
            "plugin": self.plugin,
            "kernel": meta.name,
            "plugin_params": self.plugin_params,
            "params": {"inputs": list(self.inputs), "int32": list(self.extras), "outputs": list(self.outputs)},
            "grid": list(self.grid),
            "block_threads": self.threads,
            "num_warps": meta.num_warps,
            "shared_memory_bytes": meta.shared,
            "global_scratch_bytes": meta.global_scratch_size,
            "shapes": self.shapes,
        }


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ShapeError(name, message)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_dtype(dtype: str) -> None:
    _require(dtype in DTYPES, "dtype", f"the kernels support {', '.join(DTYPES)}, not {dtype!r}")


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    _require(num_kv_heads >= 1, "num_kv_heads", f"must be >= 1, got {num_kv_heads}")
    _require(num_heads >= 1, "num_heads", f"must be >= 1, got {num_heads}")
    _require(num_heads % num_kv_heads == 0, "num_heads",
             f"{num_heads} is not a multiple of the KV head count ({num_kv_heads})")  # fmt: skip


def check_head_dim(head_dim: int) -> None:
    # The prologue's RoPE halves are tl.dot tiles (>= 16 wide, power of two); attention's
    # head tile is tl.arange(0, head_dim).
    _require(_power_of_two(head_dim) and head_dim >= 2 * attention_launch.MIN_DOT, "head_dim",
             f"must be a power of two >= {2 * attention_launch.MIN_DOT}, got {head_dim}")  # fmt: skip


def check_block_size(block_size: int) -> None:
    # Attention walks keys in its own tiles, whatever the pool's block size.
    _require(block_size >= 1, "block_size", f"must be >= 1, got {block_size}")


def head_dim_of(width: int, heads: int, name: str) -> int:
    """`width // heads`, refusing a width that does not split into `heads` equal heads."""
    _require(heads >= 1 and width % heads == 0, name, f"width {width} does not split into {heads} heads")
    return width // heads


def prologue_kernel(arch: int, dtype: str, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    eps: float, tactic: int = 1) -> PluginKernel:  # fmt: skip
    """`trtserve::FusedRMSNormQKVRoPE`: always with a bias input (zeros when the model has none),
    int64 positions and cos/sin tables in the model dtype; `tactic` picks the tile shape."""
    check_dtype(dtype)
    _require(hidden >= 1, "hidden", f"must be >= 1, got {hidden}")
    check_heads(num_heads, num_kv_heads)
    check_head_dim(head_dim)
    _require(eps >= 0, "eps", f"must be >= 0, got {eps}")
    _require(tactic in PROLOGUE_TACTICS, "tactic", f"must be one of {sorted(PROLOGUE_TACTICS)}, got {tactic}")
    name = PROLOGUE_TACTICS[tactic]
    compiled = fused_qkv.compile_for_arch(
        arch, dtype, hidden, num_heads, num_kv_heads, head_dim, has_bias=True, eps=float(eps),
        positions="*i64", cos_sin=triton_pointer(dtype), tactic=name,
    )  # fmt: skip
    tiles = fused_qkv.tiles_for(name, 4 if dtype == "float32" else 2)
    pairs = (num_heads + 2 * num_kv_heads) * head_dim // 2
    shapes = {"hidden": hidden, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
              "eps": float(eps), "tactic": name}  # fmt: skip
    return PluginKernel(
        PROLOGUE, compiled, ("x", "norm_weight", "w_qkv", "bias", "cos", "sin", "positions"), ("tokens",),
        ("q", "k", "v"), (f"ceil(batch * step / {tiles.block_t})", str(-(-pairs // tiles.block_p)), "1"), shapes,
        tiles,
    )  # fmt: skip


def prologue_head_dim(split_sizes, num_heads: int, num_kv_heads: int) -> int:
    """The head size from the prologue node's `split_sizes` (q, k, v widths), checked."""
    check_heads(num_heads, num_kv_heads)
    sizes = [int(n) for n in split_sizes]
    head_dim = head_dim_of(sizes[0], num_heads, "split_sizes") if len(sizes) == 3 else 0
    want = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    _require(head_dim > 0 and sizes == want, "split_sizes",
             f"{sizes} are not q, k, v widths for {num_heads} and {num_kv_heads} heads")  # fmt: skip
    return head_dim


def kv_write_kernel(arch: int, dtype: str, kv_width: int, block_size: int) -> PluginKernel:
    """`trtserve::PagedKVWrite`: the outputs are the pool inputs, written in place."""
    check_dtype(dtype)
    _require(kv_width >= 1, "kv_width", f"must be >= 1, got {kv_width}")
    check_block_size(block_size)
    compiled = kv_write.compile_for_arch(arch, dtype, kv_width, block_size)
    return PluginKernel(
        KV_WRITE, compiled, ("k", "v", "key_cache", "value_cache", "block_tables", "positions", "seq_lens"),
        ("step", "table_width"), ("key_cache_out", "value_cache_out"), ("batch * step", "1", "1"),
        {"kv_width": kv_width, "block_size": block_size},
    )  # fmt: skip


def _check_attention(dtype: str, num_heads: int, num_kv_heads: int, head_dim: int) -> attention_launch.AttentionTiles:
    check_dtype(dtype)
    check_heads(num_heads, num_kv_heads)
    check_head_dim(head_dim)
    return attention_launch.AttentionTiles(num_heads // num_kv_heads, head_dim, attention_launch.ELEMENT_BYTES[dtype])


def splits_in_words(tiles: attention_launch.AttentionTiles, block_size: int) -> str:
    a = attention_launch
    return (f"1 if step > {tiles.decode_rows} else min({a.MAX_SPLITS}, max(1, {a.PROGRAMS_PER_SM} * SMs // "
            f"(batch * kv_heads)), ceil(table_width * {block_size} / {a.MIN_SPLIT_KEYS}))")  # fmt: skip


def attention_kernel(arch: int, dtype: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     scale: float | None = None, window: int = 0) -> PluginKernel:  # fmt: skip
    """`trtserve::PagedAttention` (padded [batch, step] layout); `scale` defaults to
    head_dim ** -0.5, `window` 0 is full attention. Outputs ctx and the split workspace."""
    tiles = _check_attention(dtype, num_heads, num_kv_heads, head_dim)
    check_block_size(block_size)
    _require(window >= 0, "window", f"must be >= 0 (0 = full attention), got {window}")
    scale = head_dim**-0.5 if scale is None else float(scale)
    compiled = attention_launch.compile_attention(
        arch, dtype, num_kv_heads, tiles.group, head_dim, block_size, scale, int(window)
    )
    shapes = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
              "scale": scale, "window": int(window), "partials": [attention_launch.SPLIT_SLOTS, tiles.slot_width],
              "splits": splits_in_words(tiles, block_size)}  # fmt: skip
    return PluginKernel(
        ATTENTION, compiled, ("q", "key_cache", "value_cache", "block_tables", "positions"),
        ("step", "table_width", "splits"), ("ctx", "partials"),
        (f"splits * ceil(step / {tiles.prefill_rows})", str(num_kv_heads), "batch"), shapes, tiles,
    )  # fmt: skip


def merge_kernel(arch: int, dtype: str, num_heads: int, num_kv_heads: int, head_dim: int) -> PluginKernel:
    """`trtserve::PagedAttentionMerge`: ctx (aliased, written in place) from the split parts."""
    tiles = _check_attention(dtype, num_heads, num_kv_heads, head_dim)
    compiled = attention_launch.compile_merge(arch, dtype, num_kv_heads, tiles.group, head_dim)
    shapes = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    return PluginKernel(
        MERGE, compiled, ("ctx", "partials", "block_tables", "positions"), ("step", "splits"), ("ctx_out",),
        ("1", str(num_kv_heads), "batch"), shapes, tiles,
    )  # fmt: skip


@dataclass(frozen=True)
class ModelShapes:
    """A decoder's shapes, as `trtserve kernels` takes them; checked on construction."""

    dtype: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    window: int = 0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        _require(self.hidden >= 1, "hidden", f"must be >= 1, got {self.hidden}")
        check_heads(self.num_heads, self.num_kv_heads)
        check_head_dim(self.head_dim)
        check_block_size(self.block_size)
        _require(self.window >= 0, "window", f"must be >= 0 (0 = full attention), got {self.window}")
        _require(self.eps >= 0, "eps", f"must be >= 0, got {self.eps}")

    def kernels(self, arch: int) -> dict[str, PluginKernel]:
        """The plugin kernels of one decoder layer (each prologue tactic), by file stem, for `arch`."""
        prologue = {
            f"fused_rmsnorm_qkv_rope_{name}": prologue_kernel(arch, self.dtype, self.hidden, self.num_heads,
                                                              self.num_kv_heads, self.head_dim, self.eps, tactic)
            for tactic, name in PROLOGUE_TACTICS.items()
        }  # fmt: skip
        return {
            **prologue,
            "paged_kv_write": kv_write_kernel(arch, self.dtype, self.num_kv_heads * self.head_dim, self.block_size),
            "paged_attention": attention_kernel(arch, self.dtype, self.num_heads, self.num_kv_heads,
                                                self.head_dim, self.block_size, window=self.window),
            "paged_attention_merge": merge_kernel(arch, self.dtype, self.num_heads, self.num_kv_heads, self.head_dim),
        }  # fmt: skip

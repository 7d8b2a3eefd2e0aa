"""`trtserve kernels`: AOT-compile the TensorRT plugins' kernels to PTX and cubin (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import click

ARCHS = ("sm_80", "sm_89", "sm_90")


@click.command()
@click.option(
    "--arch",
    "archs",
    multiple=True,
    required=True,
    type=click.Choice(ARCHS),
    help="GPU architecture (repeatable).",
)
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@click.option("--dtype", default="float16", show_default=True, type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option("--hidden", default=576, show_default=True, type=int, help="Hidden size.")
@click.option("--num-heads", default=9, show_default=True, type=int, help="Query heads.")
@click.option("--num-kv-heads", default=3, show_default=True, type=int, help="KV heads (GQA).")
@click.option("--head-dim", default=64, show_default=True, type=int, help="Head size (power of two >= 32).")
@click.option("--block-size", default=64, show_default=True, type=int, help="KV block size.")
@click.option("--window", default=0, show_default=True, type=int, help="Sliding attention window (0 = full).")
@click.option("--eps", default=1e-5, show_default=True, type=float, help="RMSNorm epsilon (compiled in).")
def kernels(archs, out_dir: Path, dtype: str, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
            block_size: int, window: int, eps: float) -> None:  # fmt: skip
    """AOT-compile the kernels the TensorRT plugins embed, per architecture: the PTX exactly as
    TensorRT embeds it, the cubin, and a JSON of launch metadata.

    Kernels: FusedRMSNormQKVRoPE (with its bias input, int64 positions; one file per tactic),
    PagedKVWrite, PagedAttention (padded layout, scale head_dim ** -0.5) and
    PagedAttentionMerge. Needs no GPU: proves they compile for each architecture and lets a
    GPU user inspect them. Defaults are SmolLM2-135M's shapes.
    """

    try:
        from plugins_cuda.aot import HIDDEN_PARAMS
        from plugins_cuda.plugin_kernels import ModelShapes, ShapeError
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the kernels extra (pip install 'trtserve[kernels]')") from None
    try:
        shapes = ModelShapes(dtype, hidden, num_heads, num_kv_heads, head_dim, block_size, window, eps)
    except ShapeError as exc:
        raise click.BadParameter(exc.message, param_hint=f"--{exc.name.replace('_', '-')}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    for arch in archs:
        for name, kernel in shapes.kernels(int(arch[3:])).items():
            stem = f"{name}.{arch}"
            (out_dir / f"{stem}.ptx").write_text(kernel.ptx())
            (out_dir / f"{stem}.cubin").write_bytes(kernel.compiled.asm["cubin"])
            # Triton's cubin, for inspection (cuobjdump, nvdisasm): its entry keeps the hidden
            # scratch parameters the PTX drops; TensorRT compiles the PTX itself.
            info = {"arch": arch, "dtype": dtype, **kernel.launch_info(),
                    "cubin_entry_params": kernel.plugin_params + HIDDEN_PARAMS}  # fmt: skip
            (out_dir / f"{stem}.json").write_text(json.dumps(info, indent=2) + "\n")
            meta = kernel.compiled.metadata
            click.echo(f"{arch}: {out_dir / stem}.{{ptx,cubin,json}} ({kernel.plugin}, {kernel.plugin_params} "
                       f"params, {meta.shared} B shared, {meta.num_warps} warps)")  # fmt: skip

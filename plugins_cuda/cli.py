"""`trtserve kernels`: AOT-compile the GPU kernels to PTX and cubin (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.option(
    "--arch",
    "archs",
    multiple=True,
    required=True,
    type=click.Choice(["sm_80", "sm_89", "sm_90"]),
    help="GPU architecture (repeatable).",
)
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@click.option("--dtype", default="float16", show_default=True, type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option("--hidden", default=576, show_default=True, type=click.IntRange(min=16))
@click.option("--num-heads", default=9, show_default=True, type=click.IntRange(min=1))
@click.option("--num-kv-heads", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--head-dim", default=64, show_default=True, type=click.IntRange(min=32))
@click.option("--block-size", default=64, show_default=True, type=click.IntRange(min=16))
@click.option("--qkv-bias", is_flag=True, help="Compile the prologue with a QKV bias (Qwen2).")
def kernels(archs, out_dir: Path, dtype: str, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
            block_size: int, qkv_bias: bool) -> None:  # fmt: skip
    """AOT-compile the GPU kernels (Triton language) to PTX and cubin, with launch metadata.

    Kernels: paged attention, and fused RMSNorm -> QKV -> RoPE. Needs no GPU: proves they
    compile for each architecture and lets a GPU user inspect them. Defaults are
    SmolLM2-135M's shapes.
    """

    try:
        from plugins_cuda import fused_qkv, paged_attention
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the kernels extra (pip install 'trtserve[kernels]')") from None
    if num_heads % num_kv_heads:
        raise click.ClickException(f"--num-heads ({num_heads}) must be a multiple of --num-kv-heads ({num_kv_heads})")
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = {"hidden": hidden, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
              "block_size": block_size, "qkv_bias": qkv_bias}  # fmt: skip
    for arch in archs:
        sm = int(arch[3:])
        builds = {
            "paged_attention": paged_attention.compile_for_arch(
                sm, dtype, num_kv_heads, num_heads // num_kv_heads, head_dim, block_size
            ),
            "fused_rmsnorm_qkv_rope": fused_qkv.compile_for_arch(
                sm, dtype, hidden, num_heads, num_kv_heads, head_dim, qkv_bias
            ),
        }
        for name, compiled in builds.items():
            stem, meta = f"{name}.{arch}", compiled.metadata
            (out_dir / f"{stem}.ptx").write_text(compiled.asm["ptx"])
            (out_dir / f"{stem}.cubin").write_bytes(compiled.asm["cubin"])
            info = {"kernel": meta.name, "arch": arch, "dtype": dtype, "num_warps": meta.num_warps,
                    "shared_memory_bytes": meta.shared, "global_scratch_bytes": meta.global_scratch_size,
                    "shapes": shapes}  # fmt: skip
            (out_dir / f"{stem}.json").write_text(json.dumps(info, indent=2) + "\n")
            click.echo(f"{arch}: {out_dir / stem}.{{ptx,cubin,json}} ({meta.shared} B shared, {meta.num_warps} warps)")

"""`python -m plugins_cuda.resources`: what each kernel and tile config costs a GPU, read off its
AOT build (no GPU needed): registers per thread, spill stores/loads and stack from `ptxas -v`
(Triton's bundled ptxas, Triton's flags), shared memory from Triton's metadata, and whether the
PTX uses wgmma (sm_90's warpgroup MMA), mma.sync and cp.async (the pipelined loads).

Why: the speed of these kernels cannot be measured without a GPU, but their failure modes can
be read from the compile: spills put the accumulator in local memory, shared memory above 227 KB
(sm_90) / 163 KB (sm_80) does not launch, and a prefill whose sm_90 PTX has no wgmma runs on
the older mma.sync path. Llama-3-8B shapes (32/8 heads, head_dim 128, block 16), bf16, plus the
one-block K/V path (block 64) and SmolLM2's head_dim 64. Writes --out/kernel-resources.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def ptxas_report(compiled) -> dict:
    """Registers, spills and stack of `compiled`'s PTX assembled as Triton assembles it."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = compiled.asm["ptx"]
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    fmad = [] if compiled.metadata.enable_fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        ptxas = get_ptxas(compiled.metadata.target.arch).path
        cmd = [ptxas, "-v", *fmad, "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame")}  # fmt: skip


def describe(name: str, config: str, arch: int, compiled) -> dict:
    ptx, meta = compiled.asm["ptx"], compiled.metadata
    return {"kernel": name, "config": config, "arch": arch, **ptxas_report(compiled), "shared": meta.shared,
            "shared_limit": SHARED_LIMIT[arch], "warps": meta.num_warps, "stages": meta.num_stages,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca")}  # fmt: skip


def _ragged_signature(dtype: str, names: list[str], extra: dict[str, str]) -> dict[str, str]:
    from plugins_cuda.aot import triton_pointer

    pointer = triton_pointer(dtype)
    return {"q_ptr": pointer, "k_cache_ptr": pointer, "v_cache_ptr": pointer, "block_tables_ptr": "*i64",
            "positions_ptr": "*i64", "query_start_ptr": "*i32", **extra,
            **dict.fromkeys(names, "constexpr")}  # fmt: skip


def builds(arch: int):
    """(name, config, compile thunk) for every kernel and tile config the report covers."""
    from plugins_cuda import attention_launch, decoder_tails, fused_qkv, prologue_gemm
    from plugins_cuda.aot import compile_kernel, triton_pointer
    from plugins_cuda.decode_attention import DecodeTiles, paged_decode_kernel
    from plugins_cuda.prefill_attention import PrefillTiles, paged_prefill_kernel

    common = ["SCALE", "WINDOW", "NUM_KV_HEADS", "GROUP", "HEAD_DIM", "BLOCK_SIZE", "BLOCK_M", "BLOCK_N"]
    for group, dim, block in ((4, 128, 16), (4, 128, 64), (3, 64, 16)):
        base = {"SCALE": dim**-0.5, "WINDOW": 0, "NUM_KV_HEADS": 8 if dim == 128 else 3, "GROUP": group,
                "HEAD_DIM": dim, "BLOCK_SIZE": block}  # fmt: skip
        p = PrefillTiles.for_shape(group, dim, 2, arch)
        sig = _ragged_signature("bfloat16", common, {"max_rows": "i32", "table_width": "i32", "out_ptr": "*bf16"})
        yield ("prefill", f"g{group} d{dim} block{block}: {p.block_m}x{p.block_n}",
               lambda p=p, sig=sig, base=base: compile_kernel(paged_prefill_kernel, sig,
               {**base, "BLOCK_M": p.block_m, "BLOCK_N": p.block_n}, arch, p.num_warps, p.num_stages))  # fmt: skip
        d = DecodeTiles(group, dim, 2, arch)
        for split in (False, True):
            sig = _ragged_signature("bfloat16", [*common, "SPLIT"], {"table_width": "i32", "splits": "i32",
                                    "out_ptr": "*bf16", "partials_ptr": "*fp32"})  # fmt: skip
            yield ("decode" + (" split" if split else ""), f"g{group} d{dim} block{block}: {d.block_m}x{d.block_n}",
                   lambda d=d, sig=sig, base=base, split=split: compile_kernel(paged_decode_kernel, sig,
                   {**base, "BLOCK_M": d.block_m, "BLOCK_N": d.block_n, "SPLIT": split}, arch, d.num_warps,
                   d.num_stages))  # fmt: skip
    yield ("plugin attention (padded)", "g4 d128 block16", lambda: attention_launch.compile_attention(
        arch, "bfloat16", 8, 4, 128, 16, 128**-0.5))  # fmt: skip
    yield ("plugin merge", "g4 d128", lambda: attention_launch.compile_merge(arch, "bfloat16", 8, 4, 128))
    for tactic in fused_qkv.TACTICS:
        yield (f"prologue fused {tactic}", "hidden 4096, 32/8 heads", lambda t=tactic: fused_qkv.compile_for_arch(
            arch, "bfloat16", 4096, 32, 8, 128, True, tactic=t))  # fmt: skip
    pointer = triton_pointer("bfloat16")
    sig = {"x_ptr": pointer, "norm_ptr": pointer, "out_ptr": pointer, **dict.fromkeys(("EPS", "HIDDEN", "BLOCK_H"),
           "constexpr")}  # fmt: skip
    yield ("prologue gemm: rmsnorm", "hidden 4096", lambda: compile_kernel(prologue_gemm.rmsnorm_kernel, sig,
           {"EPS": 1e-5, "HIDDEN": 4096, "BLOCK_H": 4096}, arch, num_warps=8))  # fmt: skip
    sig = {"qkv_ptr": pointer, "bias_ptr": pointer, "cos_ptr": pointer, "sin_ptr": pointer, "positions_ptr": "*i64",
           "tokens": "i32", "q_ptr": pointer, "k_ptr": pointer, "v_ptr": pointer,
           **dict.fromkeys(("NUM_Q_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "BLOCK_T", "HAS_BIAS"),
                           "constexpr")}  # fmt: skip
    yield ("prologue gemm: rope epilogue", "32/8 heads d128", lambda: compile_kernel(
        prologue_gemm.rope_split_kernel, sig, {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128,
        "BLOCK_T": prologue_gemm.ROPE_TOKENS, "HAS_BIAS": True}, arch))  # fmt: skip
    sig = {"hidden_ptr": pointer, "delta_ptr": pointer, "norm_ptr": pointer, "sum_ptr": pointer, "out_ptr": pointer,
           "tokens": "i32", **dict.fromkeys(("EPS", "HIDDEN", "BLOCK_T", "BLOCK_H", "HAS_DELTA"),
                                            "constexpr")}  # fmt: skip
    tail = {"EPS": 1e-5, "HIDDEN": 4096, "BLOCK_T": 1, "BLOCK_H": 4096, "HAS_DELTA": True}
    yield ("tail: add + rmsnorm", "hidden 4096", lambda: compile_kernel(decoder_tails.add_rms_norm_kernel, sig,
           tail, arch, num_warps=8))  # fmt: skip
    sig = {"gate_up_ptr": pointer, "out_ptr": pointer, "tokens": "i32",
           **dict.fromkeys(("INTER", "BLOCK_T", "BLOCK_I"), "constexpr")}  # fmt: skip
    yield ("tail: silu * up", "intermediate 14336", lambda: compile_kernel(decoder_tails.silu_mul_kernel, sig,
           {"INTER": 14336, "BLOCK_T": 4, "BLOCK_I": 1024}, arch))  # fmt: skip


def markdown(rows: list[dict], versions: dict) -> str:
    keys = ["kernel", "config", "arch", "registers", "spill_stores", "spill_loads", "stack", "shared", "warps",
            "stages", "wgmma", "mma_sync", "cp_async"]  # fmt: skip
    lines = ["# Kernel resources from the AOT build (no GPU)", "",
             f"Triton {versions['triton']}, ptxas {versions['ptxas']}. Registers per thread, spills and stack in "
             "bytes per thread (ptxas -v), shared memory in bytes per block (Triton's dynamic allocation), "
             "and instruction counts in the PTX. Speed is not measured here: `python -m plugins_cuda.bench` on a GPU.",
             "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]  # fmt: skip
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins_cuda.resources", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="80, 89, 90 (repeatable; default 80 and 90)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "benchmarks" / "results")
    args = parser.parse_args(argv)
    import triton
    from triton.backends.nvidia.compiler import get_ptxas_version

    rows = []
    for arch in args.arch or (80, 90):
        for name, config, build in builds(arch):
            rows.append(describe(name, config, arch, build()))
            print(json.dumps(rows[-1]), flush=True)
    ptxas = {arch: get_ptxas_version(arch).strip().splitlines()[-1].split("/")[0] for arch in (80, 90)}
    versions = {"triton": triton.__version__, "ptxas": f"{ptxas[80]} (sm_80/89), {ptxas[90]} (sm_90)"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel-resources.json").write_text(json.dumps({"versions": versions, "rows": rows}, indent=1) + "\n")
    (args.out / "kernel-resources.md").write_text(markdown(rows, versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PTX for TensorRT's AOT plugins from Triton-compiled kernels (runs on CPU, no GPU needed).

TensorRT launches an AOT plugin kernel with exactly: the node's input pointers, the int32
extra arguments, the output pointers. Triton (3.x) appends two hidden pointer parameters
(global and profile scratch) to every kernel; with both scratch sizes 0 the kernel never
reads them, so they are removed from the PTX entry here rather than launched with arguments
TensorRT does not pass. Verified on CPU: the stripped PTX assembles with `ptxas`
(tests/test_tensorrt.py, tests/test_plugin_kernels.py). Whether TensorRT then runs it
correctly is unverified (no GPU).

Also the two things every kernel's AOT compilation shares: the dtype -> Triton pointer type
map and the `triton.compile` call.
"""

from __future__ import annotations

import re

HIDDEN_PARAMS = 2
POINTERS = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}  # the kernels' float dtypes
DTYPES = tuple(POINTERS)


def triton_pointer(dtype: str) -> str:
    """Triton's signature type for a pointer to `dtype` ("float16" -> "*fp16")."""
    if dtype not in POINTERS:
        raise ValueError(f"the GPU kernels support {', '.join(DTYPES)}, not {dtype!r}")
    return POINTERS[dtype]


def compile_kernel(fn, signature: dict[str, str], constexprs: dict, arch: int, num_warps: int = 4,
                   num_stages: int = 3, fp_fusion: bool = True):  # fmt: skip
    """AOT-compile the `@triton.jit` kernel `fn` for one GPU architecture (80, 89, 90, ...);
    needs no GPU. Returns Triton's CompiledKernel: `.asm["ptx"]`, `.asm["cubin"]`, `.metadata`.

    FP fusion (FMA contraction) is pinned on, Triton 3.9's default, which Triton 3.10 turns
    off: the PTX does not change with the Triton version's default. Every pointer is declared
    16-byte aligned, as Triton's JIT specializes aligned launches (TensorRT aligns plugin I/O
    to 256 bytes): without it no load is vectorized and every element costs its own address.
    `fp_fusion=False`: kernels whose rounding must match numpy's bit for bit (the quantized KV writes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        raise RuntimeError(
            f"cannot AOT-compile {getattr(fn, '__name__', fn)}: its module was imported with TRITON_INTERPRET=1"
        )
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
               if kind.startswith("*")}  # fmt: skip
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"enable_fp_fusion": fp_fusion, "num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def plugin_ptx(compiled, plugin_params: int) -> str:
    """The kernel's PTX with Triton's hidden trailing parameters removed.

    `plugin_params`: inputs + int32 extra arguments + outputs of the plugin. Raises ValueError
    when the entry does not have exactly that many parameters plus the hidden ones, when a
    scratch size is not 0, or when the kernel reads a hidden parameter."""
    meta = compiled.metadata
    if meta.global_scratch_size or getattr(meta, "profile_scratch_size", 0):
        raise ValueError(f"{meta.name} needs scratch memory, which TensorRT AOT plugins cannot provide")
    ptx = compiled.asm["ptx"]
    start = ptx.index(".entry")
    end = ptx.index(")", start)
    params = re.findall(r"\.param[^,\n]*?(\w+_param_\d+)", ptx[start:end])
    if len(params) != plugin_params + HIDDEN_PARAMS:
        raise ValueError(f"{meta.name}: {len(params)} PTX parameters, expected {plugin_params} + {HIDDEN_PARAMS}")
    hidden = params[plugin_params:]
    if any(re.search(rf"\[{name}\]", ptx[end:]) for name in hidden):
        raise ValueError(f"{meta.name} reads Triton's hidden scratch parameters")
    header = ptx[start:end]
    last = params[plugin_params - 1]
    header = header[: header.index(last) + len(last)] + "\n"  # drops its comma and the hidden lines
    return ptx[:start] + header + ptx[end:]


def current_arch() -> int:
    """Compute capability of the active GPU as an int (80, 89, 90, ...); needs a GPU."""
    import triton

    return int(triton.runtime.driver.active.get_current_target().arch)


def current_sm_count() -> int:
    """Streaming multiprocessors of the active GPU (the split-KV heuristic's target); needs a GPU."""
    import triton

    driver = triton.runtime.driver.active
    return int(driver.utils.get_device_properties(driver.get_current_device())["multiprocessor_count"])

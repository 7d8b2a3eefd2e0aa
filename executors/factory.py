"""Which backend runs an engine, and building it (each backend's module loads only when chosen: they pull in
ONNX Runtime, torch, TensorRT, and the CPU kernel's OpenMP policy must be set before torch loads)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path

from engine_format import EngineConfig
from engine_format.files import PLUGIN_GRAPH_FILE
from executors.base import EngineBackend
from executors.cpus import amx_bf16, int8_simd
from executors.kv_pool import require_kv_support

log = logging.getLogger(__name__)

BACKENDS = ("cpu", "cpu-bf16", "cpu-int8", "graph", "plugin", "tensorrt", "torch")
HOST_MEMORY_BACKENDS = frozenset({"cpu", "cpu-bf16", "cpu-int8", "graph", "plugin"})  # weights and KV in host memory


def cuda_present() -> bool:
    """An NVIDIA device is visible and torch is installed, found without importing torch or
    initializing CUDA (the CPU backend's kernel must load before torch's libgomp)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir()) and importlib.util.find_spec("torch") is not None


def default_backend(config: EngineConfig) -> str:
    """TensorRT for its own engines where it is installed; else torch on a GPU (unless this process
    runs Triton interpreted, TRITON_INTERPRET=1, as the kernel tests do); else the CPU backends: cpu-bf16
    for bfloat16 engines, and for float32 ones verified on it where the CPU has AMX (1.3-1.5x per decode
    step, 2-4x per prefill step there); cpu-int8 for float32 ones whose build verified and gated it, where the
    CPU has AVX512-VNNI or AVX2 (int8 dense layers: 2.1-3.3x per decode step with VNNI, 1.2-2.7x with AVX2);
    else ONNX Runtime with our kernel (`cpu`), or its graph alone.
    An int8/fp8 KV cache with CPU segments: the CPU kernel backend, where the gate ran (the graphs and torch
    read it too, torch's quantized kernels verified interpreted only; TensorRT does not)."""
    if config.kv_quantized and config.has_cpu_segments:
        return "cpu"
    if config.target == "tensorrt" and importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    if cuda_present() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "torch"
    if config.target == "tensorrt":
        return "tensorrt"  # refuses with the reason (no TensorRT, no GPU)
    if config.dtype == "bfloat16":
        return "cpu-bf16"  # ONNX Runtime has no bfloat16 MatMul on CPUs
    if "cpu-bf16" in config.verified_backends and amx_bf16():
        return "cpu-bf16"
    if "cpu-int8" in config.verified_backends and int8_simd():
        return "cpu-int8"
    return "cpu" if config.has_cpu_segments else "graph"


def create_backend(
    config: EngineConfig,
    num_blocks: int | None = None,
    threads: int | None = None,
    kind: str | None = None,
    max_num_batched_tokens: int | None = None,
    dtype: str | None = None,
) -> EngineBackend:
    """The backend `kind` (one of BACKENDS; default: default_backend) over `num_blocks` KV blocks.
    `max_num_batched_tokens`: the engine's step budget, checked against a TensorRT plan's profiles.
    `dtype`: the torch backend's compute dtype (default: the engine's); the other backends refuse another."""
    return prepare_backend(config, num_blocks, threads, kind, max_num_batched_tokens, dtype)()


def prepare_backend(
    config: EngineConfig,
    num_blocks: int | None = None,
    threads: int | None = None,
    kind: str | None = None,
    max_num_batched_tokens: int | None = None,
    dtype: str | None = None,
) -> Callable[[], EngineBackend]:
    """create_backend in two halves: this one checks the arguments and imports the backend's modules (which set
    the CPU kernel's OpenMP policy); the callable it returns builds the backend (weights, kernels, KV pool). Work
    that imports torch (transformers: the tokenizer) may run beside the second half, not before the first."""
    if kind is None:
        kind = default_backend(config)
        log.info("backend %s: the default for this engine on this machine (choose another with --backend)", kind)
    if dtype is not None and dtype != config.dtype and kind != "torch":
        raise ValueError(
            f"only the torch backend computes in another dtype than the engine's ({config.dtype}): "
            f"backend {kind!r} cannot run it in {dtype}"
        )
    if kind in BACKENDS:
        require_kv_support(config, kind)
    if kind == "tensorrt":
        from executors.tensorrt import TrtBackend  # imports TensorRT and CUDA: GPU machines only

        return lambda: TrtBackend(config, num_blocks, max_num_batched_tokens)
    if kind == "torch":
        from executors.torch import TorchBackend  # imports torch and the Triton kernels

        return lambda: TorchBackend(config, num_blocks, dtype=dtype)
    if kind == "cpu":
        from executors.ort_cpu import OrtCpuBackend  # loads the kernel, which sets the OpenMP policy

        return lambda: OrtCpuBackend(config, num_blocks, threads)
    if kind == "cpu-bf16":
        from executors.torch_cpu import TorchCpuBackend  # loads the kernel, then torch

        return lambda: TorchCpuBackend(config, num_blocks, threads)
    if kind == "cpu-int8":
        from executors.cpu_int8 import Int8CpuBackend  # sets the OpenMP spin policy, then loads the kernel

        return lambda: Int8CpuBackend(config, num_blocks, threads)
    if kind in ("graph", "plugin"):
        from executors.ort_graph import OrtGraphBackend

        graph = config.with_graph(PLUGIN_GRAPH_FILE) if kind == "plugin" else config
        return lambda: OrtGraphBackend(graph, num_blocks, threads, cover_step=kind == "plugin")
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {kind!r})")

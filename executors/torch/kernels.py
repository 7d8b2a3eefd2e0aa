"""The Triton kernel modules the torch backend launches, loaded for its device: compiled for CUDA, or on
CPU run by Triton's interpreter, which `triton.jit` chooses when a kernel module is first imported
(TRITON_INTERPRET=1). One process runs them one way only."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from engine_format import EngineLoadError


@dataclass(frozen=True)
class Kernels:
    attention: ModuleType  # plugins_cuda.attention_launch
    kv_write: ModuleType  # plugins_cuda.kv_write
    prologue: ModuleType  # plugins_cuda.prologue_gemm: the QKV matmul, then bias + RoPE in one kernel
    attention_quant: ModuleType  # plugins_cuda.paged_attention_quant: int8/fp8 pools
    kv_write_quant: ModuleType  # plugins_cuda.kv_write_quant
    tails: ModuleType  # plugins_cuda.decoder_tails: residual add + RMSNorm, SiLU * up
    lora: ModuleType  # plugins_cuda.lora: the SGMV shrink + expand of LoRA adapters (executors/torch/lora.py)
    interpreted: bool


def load_kernels(device: torch.device) -> Kernels:
    interpret = device.type != "cuda"
    if interpret:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Imported by name: plugins_cuda is untyped (mypy checks executors/ strictly) and must load only now.
    names = ("attention_launch", "kv_write", "prologue_gemm", "paged_attention_quant", "kv_write_quant")
    attention, kv_write, prologue, attention_quant, kv_write_quant, tails, lora = (
        importlib.import_module(f"plugins_cuda.{name}") for name in (*names, "decoder_tails", "lora")
    )
    interpreted = type(kv_write.paged_kv_write_kernel).__name__ == "InterpretedFunction"
    if interpreted != interpret:
        raise EngineLoadError(
            f"the Triton kernels were imported {'interpreted' if interpreted else 'compiled'} in this process "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}) but the device is {device}: run "
            "CPU (interpreted) and CUDA backends in separate processes"
        )
    return Kernels(attention, kv_write, prologue, attention_quant, kv_write_quant, tails, lora, interpreted)

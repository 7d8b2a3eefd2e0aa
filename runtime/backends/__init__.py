"""Engine backends: the executors of one engine step (`EngineBackend.step`, see base.py).

One vocabulary: an engine's *target* (engine_format.TARGETS) is what it was compiled for;
a *backend* (BACKENDS) is what runs it in this process:
- "cpu": the graph segments on ONNX Runtime with trtserve's paged-attention kernel between
  them (float32 engines; the default where the engine has segments);
- "cpu-bf16": the same steps with the dense layers in bfloat16 on torch (oneDNN, AMX where the CPU
  has it) instead of ONNX Runtime (float32 engines; runtime/backends/torch_cpu.py);
- "graph": the whole portable graph on ONNX Runtime (any dtype);
- "plugin": the TensorRT plugin graph on ONNX Runtime, plugin ops through their reference bodies;
- "tensorrt": the compiled plan on a GPU (the default for target "tensorrt" where TensorRT is installed);
- "torch": the engine's weights in torch with trtserve's Triton kernels (runtime/backends/torch/):
  on CUDA the default where TensorRT is missing; on CPU the kernels run in Triton's interpreter.

A backend may also sample on its device (`DeviceSampling`): the engine then gets token ids back
instead of [batch, vocab] logits. Rows are duck-typed (`SamplingRow`, which the engine's
SamplingState satisfies) because backends sit below runtime.engine.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from engine_format import EngineConfig
from engine_format.files import PLUGIN_GRAPH_FILE
from runtime.backends.base import EngineBackend, SequenceChunk
from runtime.backends.kv_pool import require_kv_support

BACKENDS = ("cpu", "cpu-bf16", "graph", "plugin", "tensorrt", "torch")

# (token_id, logprob, top-n [(token_id, logprob)] descending): runtime.engine's TokenLogprobs fields.
RowLogprobs = tuple[int, float, list[tuple[int, float]]]


class SamplingOptions(Protocol):
    """The SamplingParams fields a sampler reads."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def greedy(self) -> bool: ...


class SamplingRow(Protocol):
    """One request's sampling state (runtime.engine.sampler.SamplingState)."""

    @property
    def params(self) -> SamplingOptions: ...
    @property
    def rng(self) -> np.random.Generator: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def output_counts(self) -> np.ndarray: ...
    @property
    def seen(self) -> np.ndarray: ...
    @property
    def penalized(self) -> bool: ...


@dataclass(frozen=True)
class DeviceSample:
    token_ids: np.ndarray  # [B] int64; -1 where the row was not sampled
    logprobs: list[RowLogprobs | None]  # per row; None unless its params ask for logprobs


@runtime_checkable
class DeviceSampling(Protocol):
    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingRow | None]) -> DeviceSample:
        """`step(chunks)`, then sample row i from its last token's logits with rows[i] (None: not
        sampled, a prompt chunk short of its prompt's end), on the device."""
        ...


def check_chunks(chunks: Sequence[SequenceChunk], config: EngineConfig, num_blocks: int) -> None:
    """Refuse a step the GPU kernels would index the pool with unchecked: a block table short of
    the chunk's positions or naming a block outside the pool, positions past max_seq_len, token
    ids outside the vocabulary, logit rows outside the chunk. ValueError names the chunk."""
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    bs, vocab = config.block_size, config.model.vocab_size
    for i, c in enumerate(chunks):
        n, end = len(c.token_ids), c.past_len + len(c.token_ids)
        if n < 1 or c.past_len < 0 or end > config.max_seq_len:
            raise ValueError(
                f"chunk {i}: {n} tokens after past_len {c.past_len} must fit in 1..{config.max_seq_len} positions"
            )
        if not 1 <= c.num_logits <= n:
            raise ValueError(f"chunk {i}: num_logits {c.num_logits} must be in 1..{n} (its tokens)")
        need = -(-end // bs)
        if len(c.block_table) < need:
            raise ValueError(
                f"chunk {i}: block table of {len(c.block_table)} blocks covers {len(c.block_table) * bs} "
                f"positions, {end} needed"
            )
        table = np.asarray(c.block_table[:need], np.int64)
        outside = table[(table < 0) | (table >= num_blocks)]
        if outside.size:
            raise ValueError(f"chunk {i}: block table names block {outside[0]}, outside the pool (0..{num_blocks - 1})")
        ids = np.asarray(c.token_ids, np.int64)
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"chunk {i}: token ids must be in [0, {vocab}) (got {ids.min()}..{ids.max()})")


def cuda_present() -> bool:
    """An NVIDIA device is visible and torch is installed, found without importing torch or
    initializing CUDA (the CPU backend's kernel must load before torch's libgomp)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir()) and importlib.util.find_spec("torch") is not None


def default_backend(config: EngineConfig) -> str:
    """TensorRT for its own engines where it is installed; else torch on a GPU (unless this process
    runs Triton interpreted, TRITON_INTERPRET=1, as the kernel tests do); else ONNX Runtime.
    An int8/fp8 KV cache: the CPU kernel backend (the graphs read it too, but torch and TensorRT do not)."""
    if config.kv_quantized and config.has_cpu_segments:
        return "cpu"
    if config.target == "tensorrt" and importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    if cuda_present() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "torch"
    if config.target == "tensorrt":
        return "tensorrt"  # refuses with the reason (no TensorRT, no GPU)
    return "cpu" if config.has_cpu_segments else "graph"


def create_backend(
    config: EngineConfig, num_blocks: int | None = None, threads: int | None = None, kind: str | None = None,
    max_num_batched_tokens: int | None = None,
) -> EngineBackend:  # fmt: skip
    """The backend `kind` (one of BACKENDS; default: default_backend) over `num_blocks` KV blocks.
    `max_num_batched_tokens`: the engine's step budget, checked against a TensorRT plan's profiles."""
    kind = kind or default_backend(config)
    if kind in BACKENDS:
        require_kv_support(config, kind)
    if kind == "tensorrt":
        from runtime.backends.tensorrt import TrtBackend  # imports TensorRT and CUDA: GPU machines only

        return TrtBackend(config, num_blocks, max_num_batched_tokens)
    if kind == "torch":
        from runtime.backends.torch import TorchBackend  # imports torch and the Triton kernels

        return TorchBackend(config, num_blocks)
    if kind == "cpu":
        from runtime.backends.ort_cpu import OrtCpuBackend  # loads the kernel, which sets the OpenMP policy

        return OrtCpuBackend(config, num_blocks, threads)
    if kind == "cpu-bf16":
        from runtime.backends.torch_cpu import TorchCpuBackend  # loads the kernel, then torch

        return TorchCpuBackend(config, num_blocks, threads)
    if kind in ("graph", "plugin"):
        from runtime.backends.ort_graph import OrtGraphBackend

        if kind == "plugin":
            config = config.with_graph(PLUGIN_GRAPH_FILE)
        return OrtGraphBackend(config, num_blocks, threads, cover_step=kind == "plugin")
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {kind!r})")

"""TensorRT engine backend (GPU only): `step(chunks) -> logits` on a compiled `model.plan`.

The KV pool is one device allocation `[layers, 2, num_blocks, block_size, kv_width]`; each
layer's K and V views are bound once as the `key_cache.{l}`/`value_cache.{l}` inputs, and the
engine's PagedKVWrite plugins write each step's rows into them in place. Per step the packed
host tensors (engine_format/INTERFACE.md; block tables cover the step) are copied to device
buffers sized for the build limits, the profile is chosen (0: decodes, 1: prefill chunks),
the engine runs on one CUDA stream (cuda-python), and the logits are copied back.

UNVERIFIED: written against TensorRT 10.x and cuda-python 12.x; never run (no GPU here).
Without TensorRT, cuda-python or a GPU, construction raises EngineLoadError (tested on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_format import EngineConfig, EngineLoadError
from engine_format.files import PLAN_FILE
from runtime.backends.base import SequenceChunk, StepTensors

STEP_INPUTS = ("input_ids", "positions", "seq_lens", "past_lens", "block_tables")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _load_gpu_modules() -> tuple[Any, Any]:
    """(tensorrt, cuda.bindings.runtime): both untyped."""
    try:
        import tensorrt as trt
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise EngineLoadError(
            f"engine built for backend 'tensorrt' needs TensorRT and cuda-python on an NVIDIA GPU ({exc.name} "
            "is not installed); rebuild with --backend onnxruntime-cpu to run on this machine"
        ) from None
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count < 1:
        raise EngineLoadError("engine built for backend 'tensorrt' needs an NVIDIA GPU; no CUDA device is visible")
    return trt, cudart


def _check(result: Any) -> Any:
    """The value(s) of a cuda-python call's (error, *values) result; raises on an error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


class TrtBackend:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None) -> None:
        self.trt, self.cudart = trt, cudart = _load_gpu_modules()
        plan = config.engine_dir / PLAN_FILE
        if not plan.is_file():
            raise EngineLoadError(f"{config.engine_dir}: {PLAN_FILE} is missing; rebuild with --target tensorrt")
        if config.tensorrt is None:
            raise EngineLoadError(
                f"{config.engine_dir}: the manifest has no TensorRT limits; rebuild with --target tensorrt"
            )
        self.config, spec, limits = config, config.model, config.tensorrt
        self.num_blocks = num_blocks or limits.max_num_blocks
        if self.num_blocks > limits.max_num_blocks:
            raise EngineLoadError(
                f"{self.num_blocks} KV blocks exceed the {limits.max_num_blocks} the plan was built for"
            )
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise EngineLoadError(f"TensorRT could not deserialize {plan} (built for another TensorRT or GPU?)")
        self.context = self.engine.create_execution_context()
        self.stream = _check(cudart.cudaStreamCreate())
        row = config.block_size * spec.kv_width * ITEMSIZE[config.dtype]
        self.pool_bytes_per_cache = self.num_blocks * row
        self.pool = _check(cudart.cudaMalloc(2 * spec.num_layers * self.pool_bytes_per_cache))
        _check(cudart.cudaMemset(self.pool, 0, 2 * spec.num_layers * self.pool_bytes_per_cache))
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        for layer in range(spec.num_layers):
            for kind, name in ((0, "key_cache"), (1, "value_cache")):
                address = int(self.pool) + (2 * layer + kind) * self.pool_bytes_per_cache
                self.context.set_tensor_address(f"{name}.{layer}", address)
        # Step inputs: int64 device buffers for the largest shapes the profiles allow.
        batch, tokens = limits.max_batch, limits.max_batch * limits.max_step
        tables = batch * limits.max_table_blocks
        sizes = {
            "input_ids": tokens,
            "positions": tokens,
            "seq_lens": batch,
            "past_lens": batch,
            "block_tables": tables,
        }
        self.buffers = {n: _check(cudart.cudaMalloc(8 * sizes[n])) for n in STEP_INPUTS if n in self.inputs}
        self.logits = _check(cudart.cudaMalloc(4 * limits.max_batch * spec.vocab_size))
        self.context.set_tensor_address("logits", int(self.logits))
        for name, buffer in self.buffers.items():
            self.context.set_tensor_address(name, int(buffer))

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        """Decodes in one call (profile 0), prefill chunks in another (profile 1), as the ORT graph backend."""
        logits = np.empty((len(chunks), self.config.model.vocab_size), np.float32)
        for profile, is_decode in ((0, True), (1, False)):
            rows = [i for i, c in enumerate(chunks) if (len(c.token_ids) == 1) == is_decode]
            if rows:
                logits[rows] = self._run([chunks[i] for i in rows], profile)
        return logits

    def _run(self, chunks: Sequence[SequenceChunk], profile: int) -> np.ndarray:
        cudart, context = self.cudart, self.context
        tensors = StepTensors.pack(chunks, self.config.block_size, cover_step=True)
        context.set_optimization_profile_async(profile, self.stream)
        for layer in range(self.config.model.num_layers):
            for name in ("key_cache", "value_cache"):
                context.set_input_shape(f"{name}.{layer}", (self.num_blocks, self.config.block_size,
                                                            self.config.model.kv_width))  # fmt: skip
        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        host = {n: np.ascontiguousarray(getattr(tensors, n), np.int64) for n in self.buffers}
        for name, array in host.items():
            context.set_input_shape(name, array.shape)
            _check(cudart.cudaMemcpyAsync(self.buffers[name], array.ctypes.data, array.nbytes, kind, self.stream))
        if not context.execute_async_v3(self.stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        out = np.empty((len(chunks), self.config.model.vocab_size), np.float32)
        back = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check(cudart.cudaMemcpyAsync(out.ctypes.data, self.logits, out.nbytes, back, self.stream))
        _check(cudart.cudaStreamSynchronize(self.stream))  # also keeps `host` alive until the copies finished
        return out

"""ONNX Runtime (CPU) engine backend over a zero-copy paged KV pool.

The pool is one numpy allocation [layers, 2, num_blocks, block_size, kv_width]; each
layer's K and V are contiguous views bound once as OrtValues, so ONNX Runtime reads them in
place every step (no copy of the pool). The graph returns only this step's K/V rows, which
are scattered into the pool with one numpy assignment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from runtime.backend import SequenceChunk, StepTensors
from runtime.engine_config import EngineConfig, EngineLoadError

log = logging.getLogger(__name__)
NP_DTYPES = {"float32": np.float32, "float16": np.float16}
STEP_INPUTS = ("input_ids", "positions", "seq_lens", "past_lens", "block_tables")


class OrtBackend:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None, threads: int | None = None):
        if config.dtype not in NP_DTYPES:
            raise EngineLoadError(f"engine dtype {config.dtype!r} has no ONNX Runtime CPU backend")
        self.config = config
        spec = config.model
        self.num_blocks = num_blocks or config.max_batch_size * config.max_blocks_per_seq
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(
                str(config.engine_dir / config.graph_file), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own exception types for bad graphs
            raise EngineLoadError(f"ONNX Runtime could not load {config.graph_file}: {exc}") from None
        self.pool = np.zeros(
            (spec.num_layers, 2, self.num_blocks, config.block_size, spec.kv_width),
            NP_DTYPES[config.dtype],
        )
        # Bound once: ORT reads these views in place on every run.
        self._pool_values = []
        self.binding = self.session.io_binding()
        for layer in range(spec.num_layers):
            for kind, name in ((0, "key_cache"), (1, "value_cache")):
                value = ort.OrtValue.ortvalue_from_numpy(self.pool[layer, kind])
                self._pool_values.append(value)
                self.binding.bind_ortvalue_input(f"{name}.{layer}", value)
        log.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB",
            self.num_blocks,
            config.block_size,
            self.num_blocks * config.block_size,
            self.pool.nbytes / 2**20,
        )

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        tensors = StepTensors.pack(chunks, self.config.block_size)
        for name in STEP_INPUTS:
            self.binding.bind_cpu_input(name, getattr(tensors, name))
        self.binding.bind_output("logits")
        self.binding.bind_output("new_kv")
        self.session.run_with_iobinding(self.binding)
        logits, new_kv = self.binding.copy_outputs_to_cpu()
        self._write_kv(new_kv, tensors)
        return logits

    def _write_kv(self, new_kv: np.ndarray, tensors: StepTensors) -> None:
        spec, bs = self.config.model, self.config.block_size
        rows = new_kv.reshape(2 * spec.num_layers, -1, spec.kv_width)[:, tensors.row_index]
        flat_pool = self.pool.reshape(2 * spec.num_layers, self.num_blocks * bs, spec.kv_width)
        flat_pool[:, tensors.slots] = rows

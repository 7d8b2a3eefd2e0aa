"""ONNX Runtime backend running the whole portable graph (`model.onnx`).

The reference backend: it runs exactly the graph the TensorRT path starts from, for any
engine dtype. The pool (see `kv_pool`) is bound once as OrtValues, so ONNX Runtime reads it
in place every step; the graph returns only this step's K/V rows, which are scattered into
the pool with one numpy assignment. Its attention gathers each sequence's blocks (a copy),
so at high batch x context the CPU backend (`ort_cpu_backend`) is much faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from engine_format import EngineConfig, EngineLoadError
from runtime.backends.base import SequenceChunk, StepTensors, num_logit_rows
from runtime.backends.kv_pool import allocate_pool, pool_rows, require_kv_support
from runtime.backends.ort_session import create_session

NP_DTYPES = {"float32": np.float32, "float16": np.float16}
STEP_INPUTS = ("input_ids", "positions", "seq_lens", "past_lens", "block_tables", "logit_rows")


class OrtGraphBackend:
    def __init__(
        self, config: EngineConfig, num_blocks: int | None = None, threads: int | None = None,
        pool: np.ndarray | None = None, cover_step: bool = False,
    ) -> None:  # fmt: skip
        """`pool`: share another backend's KV pool (same layout) instead of allocating one.
        `cover_step`: block tables also cover the step's new rows (the plugin graph needs it)."""
        self.cover_step = cover_step
        require_kv_support(config, "plugin" if cover_step else "graph")
        if config.dtype not in NP_DTYPES:
            raise EngineLoadError(f"engine dtype {config.dtype!r} has no ONNX Runtime CPU backend")
        self.config = config
        spec = config.model
        self.num_blocks = num_blocks or config.max_batch_size * config.max_blocks_per_seq
        self.session = create_session(config.engine_dir / config.graph_file, threads, quantization=config.quantization)
        self.pool = pool if pool is not None else allocate_pool(config, self.num_blocks, NP_DTYPES[config.dtype])
        # Bound once: ORT reads these views in place on every run.
        self._pool_values: list[ort.OrtValue] = []
        self.binding = self.session.io_binding()
        for layer in range(spec.num_layers):
            for kind, name in ((0, "key_cache"), (1, "value_cache")):
                value = ort.OrtValue.ortvalue_from_numpy(self.pool[layer, kind])
                self._pool_values.append(value)
                self.binding.bind_ortvalue_input(f"{name}.{layer}", value)

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        """Decodes in one call, prefill chunks in another: the graph's batch is padded to
        the longest chunk, and padding decodes to a chunk's length would multiply their cost.
        A chunk's logit rows land at its place in the step's output (chunk order)."""
        logits = np.empty((num_logit_rows(chunks), self.config.model.vocab_size), np.float32)
        first = np.cumsum([0] + [c.num_logits for c in chunks])
        for is_decode in (True, False):
            picked = [i for i, c in enumerate(chunks) if (len(c.token_ids) == 1) == is_decode]
            if picked:
                rows = np.concatenate([np.arange(first[i], first[i + 1]) for i in picked])
                logits[rows] = self._run([chunks[i] for i in picked])
        return logits

    def _run(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        tensors = StepTensors.pack(chunks, self.config.block_size, self.cover_step)
        for name in STEP_INPUTS:
            self.binding.bind_cpu_input(name, getattr(tensors, name))
        self.binding.bind_output("logits")
        self.binding.bind_output("new_kv")
        self.session.run_with_iobinding(self.binding)
        logits, new_kv = self.binding.copy_outputs_to_cpu()
        self._write_kv(new_kv, tensors)
        return logits

    def _write_kv(self, new_kv: np.ndarray, tensors: StepTensors) -> None:
        spec = self.config.model
        rows = new_kv.reshape(2 * spec.num_layers, -1, spec.kv_width)[:, tensors.row_index]
        pool_rows(self.pool)[:, tensors.slots] = rows

"""ONNX Runtime backend running the whole portable graph (`model.onnx`).

The reference backend: it runs exactly the graph the TensorRT path starts from, for any
engine dtype. The pool (see `kv_pool`) is bound once as OrtValues, so ONNX Runtime reads it
in place every step; the graph returns only this step's K/V rows, which are scattered into
the pool with one numpy assignment. Its attention gathers each sequence's blocks (a copy),
so at high batch x context the CPU backend (`ort_cpu_backend`) is much faster.

A quantized KV cache (int8/fp8, engine_format/kv_cache.py) is read and quantized in the graph:
the pool is bound as its codes (int8, or fp8's E4M3 bits as uint8), int8 adds the scale pools and
fp8 the manifest's per-layer `kv_scales`; `new_kv` returns codes (and int8 `new_kv_scales`),
scattered into the pools as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from engine_format import EngineConfig, EngineLoadError
from executors.base import SequenceChunk, StepTensors, num_logit_rows
from executors.kv_pool import KVPool, allocate_pool, pool_rows, require_kv_support
from executors.ort_session import create_session

NP_DTYPES = {"float32": np.float32, "float16": np.float16}
STEP_INPUTS = ("input_ids", "positions", "seq_lens", "past_lens", "block_tables", "logit_rows")
_T = onnx.TensorProto
POOL_NP_DTYPES = {_T.FLOAT: "float32", _T.FLOAT16: "float16", _T.INT8: "int8", _T.UINT8: "uint8"}


def graph_pool_dtype(config: EngineConfig) -> str:
    """The numpy dtype of the pool the engine's graph reads (its key_cache.0 input)."""
    graph = onnx.load(config.engine_dir / config.graph_file, load_external_data=False).graph
    for value in graph.input:
        if value.name == "key_cache.0":
            return POOL_NP_DTYPES.get(value.type.tensor_type.elem_type, "unknown")
    raise EngineLoadError(f"{config.graph_file} has no key_cache.0 input; rebuild the engine")


class OrtGraphBackend:
    def __init__(
        self, config: EngineConfig, num_blocks: int | None = None, threads: int | None = None,
        pool: np.ndarray | KVPool | None = None, cover_step: bool = False,
    ) -> None:  # fmt: skip
        """`pool`: share another backend's KV pool (same layout; a KVPool for a quantized cache) instead
        of allocating one.
        `cover_step`: block tables also cover the step's new rows (the plugin graph needs it)."""
        self.cover_step = cover_step
        require_kv_support(config, "plugin" if cover_step else "graph")
        if config.dtype not in NP_DTYPES:
            raise EngineLoadError(
                f"engine dtype {config.dtype!r} has no ONNX Runtime CPU backend (ONNX Runtime has no bfloat16 "
                f"MatMul on CPUs): run it with --backend cpu-bf16, or --backend torch on a GPU"
            )
        self.config = config
        spec = config.model
        self.num_blocks = num_blocks or config.max_batch_size * config.max_blocks_per_seq
        if (graph_pool := graph_pool_dtype(config)) != config.kv_pool_dtype:
            raise EngineLoadError(
                f"{config.graph_file} reads a {graph_pool} KV pool, the engine's is {config.kv_pool_dtype}"
            )
        self.session = create_session(config.engine_dir / config.graph_file, threads, quantization=config.quantization)
        if isinstance(pool, KVPool):
            self.kv = pool
        elif config.kv_quantized:
            if pool is not None:
                raise ValueError("a quantized KV cache is shared as its KVPool (codes and scales)")
            self.kv = KVPool.allocate(config, self.num_blocks)
        else:
            data = pool if pool is not None else allocate_pool(config, self.num_blocks, NP_DTYPES[config.dtype])
            self.kv = KVPool(config, data, None)
        self.pool = self.kv.data
        # Bound once: ORT reads these views in place on every run.
        self._pool_values: list[ort.OrtValue] = []
        self.binding = self.session.io_binding()
        for layer in range(spec.num_layers):
            for side, (cache, scales) in enumerate((("key_cache", "key_scales"), ("value_cache", "value_scales"))):
                self._bind(f"{cache}.{layer}", self.pool[layer, side])
                if self.kv.scales is not None:
                    self._bind(f"{scales}.{layer}", self.kv.scales[layer, side])
        if config.kv_cache_dtype == "fp8":
            assert config.kv_scales is not None
            self._bind("kv_scales", np.asarray(config.kv_scales, np.float32))

    def _bind(self, name: str, array: np.ndarray) -> None:
        value = ort.OrtValue.ortvalue_from_numpy(array)
        self._pool_values.append(value)
        self.binding.bind_ortvalue_input(name, value)

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
        if self.kv.scales is not None:
            self.binding.bind_output("new_kv_scales")
        self.session.run_with_iobinding(self.binding)
        logits, *new_kv = self.binding.copy_outputs_to_cpu()
        self._write_kv(new_kv, tensors)
        return logits

    def _write_kv(self, new_kv: list[np.ndarray], tensors: StepTensors) -> None:
        """new_kv (and int8 new_kv_scales) [2*layers, batch, step, width] -> the pools' slots."""
        pools = [self.kv.data] if self.kv.scales is None else [self.kv.data, self.kv.scales]
        for pool, rows in zip(pools, new_kv, strict=True):
            flat = rows.reshape(2 * self.config.model.num_layers, -1, pool.shape[-1])[:, tensors.row_index]
            pool_rows(pool)[:, tensors.slots] = flat

"""The CPU backend: ONNX Runtime for the dense layers, our kernel for paged attention.

Per step, tokens of all sequences (decodes and prefill chunks alike) are laid out flat,
with no padding, and run through the engine's segments (`segment.NN.onnx`, see
engine_format/INTERFACE.md): segment i does layer i-1's o_proj + MLP and layer i's norm + QKV +
RoPE; between segments the runtime writes the new K/V rows into the pool and the C kernel
(executors/kernels/paged_attention.c) attends over each sequence's blocks in place. Small
steps (one sequence, or a few short chunks over little context: `runs_whole_graph`) run the
whole-graph session on the same pool instead, except with a quantized KV cache (int8/fp8), whose
steps all run the segments and the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine_format import EngineConfig, EngineLoadError
from engine_format.files import segment_file
from executors.base import SequenceChunk
from executors.cpu_attention import AttentionShape, paged_attention
from executors.cpus import usable_cpus
from executors.flat_step import FlatStep, FlatStepBackend
from executors.kv_pool import KVPool
from executors.lora import ATTENTION_TARGETS, LoraSlots
from executors.lora.segments import LoraInputs, SegmentLora
from executors.ort_graph import OrtGraphBackend, graph_pool_dtype
from executors.ort_session import create_session

if TYPE_CHECKING:  # at run time onnxruntime loads after the kernel (OpenMP policy, see cpu_attention)
    import onnxruntime as ort


# The whole graph (one ORT run; ORT's attention over K/V gathered from the pool) saves the segments'
# 31 runs and their thread wake-ups; the segments (our kernel reading the pool in place) save the
# gathers. The graph pads every sequence to the longest chunk and context, so its gathers grow with
# sequences x the longest context. Measured here, SmolLM2-135M fp32, decode steps of 2-4 sequences:
# the graph is 8-15% faster up to 800 padded context tokens (4 x 200: 31.2 vs 33.4 ms; 2 x 250:
# 25.1 vs 29.4), even at ~1,200 and 15-20% slower from ~1,800 (100/100/100/500: 39.5 vs 33.8), also
# for INT4-AWQ. One sequence stays in the graph whatever it holds: faster up to ~1,000 context tokens
# (24.5 vs 29.0 ms per decode at 200), even (fp32) or 10% slower (INT4) at 1,800, and its prefill
# chunks are even (64-512 tokens, within 8%).
GRAPH_MAX_SEQS = 4
GRAPH_MAX_CHUNK = 8
GRAPH_MAX_PADDED_CONTEXT = 1000


def runs_whole_graph(chunks: Sequence[SequenceChunk]) -> bool:
    """Whether a step runs the whole-graph session rather than the segments (see above)."""
    if len(chunks) == 1:
        return True
    if len(chunks) > GRAPH_MAX_SEQS:  # the common case under load: no per-chunk scan
        return False
    short = max(len(c.token_ids) for c in chunks) <= GRAPH_MAX_CHUNK
    return short and len(chunks) * max(c.past_len + len(c.token_ids) for c in chunks) <= GRAPH_MAX_PADDED_CONTEXT


class OrtCpuBackend(FlatStepBackend):
    name = "cpu"
    # The segments fuse the MLP: an update inside it (gate/up/down) would need the graph to take it.
    lora_targets = ATTENTION_TARGETS

    def __init__(self, config: EngineConfig, num_blocks: int | None = None, threads: int | None = None) -> None:
        if config.dtype != "float32":
            raise EngineLoadError(
                f"the CPU kernel backend needs a float32 engine (got {config.dtype}); "
                f"{'--backend cpu-bf16 runs a bfloat16 one' if config.dtype == 'bfloat16' else 'use --backend graph'}"
            )
        spec = config.model
        self.config = config
        self.threads = threads or usable_cpus()
        self.num_blocks = num_blocks or config.max_batch_size * config.max_blocks_per_seq
        self.shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, config.block_size)
        self.segments: list[ort.InferenceSession] = []
        for index in range(spec.num_layers + 1):
            path = config.engine_dir / segment_file(index)
            if not path.is_file():
                raise EngineLoadError(f"{path.name} is missing: rebuild the engine with build-engine")
            self.segments.append(create_session(path, self.threads, spinning=False, quantization=config.quantization))
        self.kv = KVPool.allocate(config, self.num_blocks)
        self.pool = self.kv.data
        # The same pool, read by the whole graph for single-sequence steps (a second weights copy). Not
        # for a float view of a quantized engine (the gate's reference, fp8 calibration): its graph reads codes.
        float_graph = not config.kv_quantized and graph_pool_dtype(config) == config.kv_pool_dtype
        self.small_steps = (
            OrtGraphBackend(config, self.num_blocks, self.threads, pool=self.pool) if float_graph else None
        )

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        if self.small_steps is not None and runs_whole_graph(chunks) and self.lora is None:
            return self.small_steps.step(chunks)
        return super().step(chunks)

    def enable_lora(self, num_slots: int, max_rank: int) -> LoraSlots:
        self._lora_inputs = LoraInputs.read(self.config)
        return super().enable_lora(num_slots, max_rank)

    def _run(self, flat: FlatStep, logit_rows: np.ndarray) -> np.ndarray:
        spec = self.config.model
        hidden, q, k, v = self.segments[0].run(None, {"input_ids": flat.input_ids, "positions": flat.positions})
        lora = SegmentLora(self._lora_inputs, self.lora, flat) if self.lora is not None and flat.loras else None
        for layer in range(spec.num_layers):
            if lora is not None:
                lora.add_qkv(layer, hidden[:, 0], q[:, 0], k[:, 0], v[:, 0])
            self.kv.write(layer, flat.slots, k[:, 0], v[:, 0])
            attn = paged_attention(
                q[:, 0], self.pool[layer, 0], self.pool[layer, 1], flat.block_tables, flat.seq_of_token,
                flat.positions[:, 0], self.shape, window=spec.sliding_windows[layer], threads=self.threads,
                quant=self.kv.quant(layer),
            )[:, None]  # fmt: skip
            if lora is not None:
                lora.add_o_proj(layer, attn[:, 0], hidden[:, 0])
            feeds = {"hidden": hidden, "attn": attn}
            if layer + 1 < spec.num_layers:
                hidden, q, k, v = self.segments[layer + 1].run(None, {**feeds, "positions": flat.positions})
            else:
                (logits,) = self.segments[-1].run(None, {**feeds, "logit_rows": logit_rows})
        return logits

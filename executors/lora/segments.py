"""LoRA on the `cpu` backend's ONNX segments, which fuse RMSNorm -> QKV -> RoPE (and o_proj + the MLP) inside
graphs that take no adapter weights: the updates are added between the segments instead, exactly.

- q, k, v: a segment returns the residual stream `hidden` beside the rotated q, k and v, so the projection's
  input is RMSNorm(hidden) (recomputed here for the adapters' rows), and RoPE is linear: RoPE(q + dq) =
  RoPE(q) + RoPE(dq). The delta is rotated at the tokens' positions and added to the segment's outputs.
- o_proj: the next segment adds o_proj(attn) to `hidden`, so adding the delta to `hidden` first is the same sum.
The MLP's projections sit between nonlinearities inside a segment: the `cpu` backend does not update them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_format import EngineConfig
from executors.engine_weights import WeightReader
from executors.flat_step import FlatStep
from executors.int8_ops import rope_split
from executors.lora.norms import NormWeights
from executors.lora.slots import LoraSlots


@dataclass(frozen=True)
class LoraInputs:
    """What the q/k/v updates need beside the segments' outputs: each layer's input RMSNorm and RoPE's tables."""

    norms: NormWeights
    cos: np.ndarray  # float32 [max_positions, head_dim], rotate-half form (as executors/int8_ops.rope_split takes)
    sin: np.ndarray
    heads: int
    kv_heads: int

    @classmethod
    def read(cls, config: EngineConfig) -> LoraInputs:
        reader, spec = WeightReader(config), config.model
        cos, sin = reader.array("rope_cos").astype(np.float32), reader.array("rope_sin").astype(np.float32)
        return cls(
            norms=NormWeights.read(config),
            cos=np.ascontiguousarray(np.concatenate([cos, cos], axis=1)),
            sin=np.ascontiguousarray(np.concatenate([-sin, sin], axis=1)),
            heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
        )

    def update_qkv(
        self, lora: LoraSlots, flat: FlatStep, layer: int, hidden: np.ndarray, qkv: tuple[np.ndarray, ...]
    ) -> None:
        """Add the adapters' rotated q/k/v updates, in place, to a segment's q, k, v [T, width] (views)."""
        if not lora.updates_group(flat.loras, layer, "qkv"):
            return
        rows = flat.loras.rows
        delta = lora.delta(flat.loras, layer, "qkv", hidden, self.norms.input_norms[layer], self.norms.eps)
        rotated = rope_split(delta, self.heads, self.kv_heads, self.cos, self.sin, flat.positions[rows, 0])
        for out, part in zip(qkv, rotated, strict=True):
            out[rows] += part

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
from executors.lora.norms import NormWeights
from executors.lora.slots import LoraSlots, Rope


@dataclass(frozen=True)
class LoraInputs:
    """What the q/k/v updates need beside the segments' outputs: each layer's input RMSNorm and RoPE's tables."""

    norms: NormWeights
    cos: np.ndarray  # float32 [max_positions, head_dim], rotate-half form (as the LoRA kernel's RoPE takes)
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


class SegmentLora:
    """A step's adapters between the segments: what they update (looked up once a step) and RoPE at the step's
    positions. One kernel call a projection and layer: between the segments, whose runs evict the caches, each
    numpy call costs tens of microseconds."""

    def __init__(self, inputs: LoraInputs, slots: LoraSlots, flat: FlatStep) -> None:
        self.inputs, self.slots, self.tokens = inputs, slots, flat.loras
        self.groups = slots.groups(flat.loras)
        rotated = (inputs.heads + inputs.kv_heads) * inputs.cos.shape[1]  # q's and k's columns of q|k|v
        self.rope = Rope(inputs.cos, inputs.sin, np.ascontiguousarray(flat.positions[:, 0], np.int64), rotated)

    def add_qkv(self, layer: int, hidden: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Add the rotated q/k/v updates, in place, to a segment's q, k, v [T, width] (C-contiguous views)."""
        if (layer, "qkv") in self.groups:
            norms = self.inputs.norms
            self.slots.add(
                self.tokens, layer, "qkv", hidden, (q, k, v), norms.input_norms[layer], norms.eps, rope=self.rope
            )

    def add_o_proj(self, layer: int, attn: np.ndarray, hidden: np.ndarray) -> None:
        """Add the o_proj update to the residual stream `hidden` the next segment adds o_proj(attn) to."""
        if (layer, "o_proj") in self.groups:
            self.slots.add(self.tokens, layer, "o_proj", attn, (hidden,))

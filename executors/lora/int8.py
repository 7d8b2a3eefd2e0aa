"""LoRA on the cpu-int8 backend (executors/cpu_int8.py), whose dense layers run in int8 with SmoothQuant's factors
folded into their weights and norms: each adapter's update is computed in float32 from the projection's real
float32 input, for the adapters' rows only, and added to the backend's float32 output of that projection.

- qkv, gate_up: the real input is RMSNorm(hidden) x the model's own norm weight (the backend's norms have the
  smoothing factors divided in), recomputed here from the unsmoothed weights.
- gate_up: the backend's up columns are divided by down's smoothing factors s_down (so that silu(gate) * up is
  down's smoothed input): up's update is divided by them too, and the sum stays in the backend's space.
- down: its real input is silu(gate) * up x s_down, from gate_up with the updates above in it.
- o_proj, down: the backend adds their outputs into the residual stream; their updates go there as well.
The updates are exact in float32; only the base projections are quantized.
"""

from __future__ import annotations

import numpy as np

from executors.lora.norms import NormWeights
from executors.lora.slots import LoraRows, LoraSlots


class StepLora:
    """One step's adapter updates, computed for the step's LoRA rows alone (`tokens.rows`)."""

    def __init__(self, slots: LoraSlots, norms: NormWeights, tokens: LoraRows) -> None:
        self.slots, self.norms, self.tokens = slots, norms, tokens
        self.rows = tokens.rows
        self.groups = slots.groups(tokens)  # what the step's adapters update, looked up once a step

    def _updates(self, layer: int, group: str) -> bool:
        return (layer, group) in self.groups

    def _add(
        self,
        out: np.ndarray,
        layer: int,
        group: str,
        x: np.ndarray,
        norm: np.ndarray | None = None,
        up_divisor: np.ndarray | None = None,
        x_rows: np.ndarray | None = None,
    ) -> None:
        """Add the adapters' update of `group` to the LoRA rows of `out` [T, width]; its input is those rows of
        `x` (x_rows of it, if given), RMS-normalized with `norm` if given."""
        if up_divisor is None:  # added by the kernel, in place
            self.slots.add(self.tokens, layer, group, x, (out,), norm, self.norms.eps, x_rows)
            return
        delta = self.slots.delta(self.tokens, layer, group, x, norm, self.norms.eps, x_rows)
        delta[:, delta.shape[1] // 2 :] /= up_divisor
        out[self.rows] += delta

    def add_qkv(self, qkv: np.ndarray, hidden: np.ndarray, layer: int) -> None:
        """Into the fused q|k|v output [T, width], before RoPE; `hidden`: the layer's input residual stream."""
        if self._updates(layer, "qkv"):
            self._add(qkv, layer, "qkv", hidden, self.norms.input_norms[layer])

    def add_o_proj(self, hidden: np.ndarray, attn: np.ndarray, layer: int) -> None:
        """Into the residual stream, from the attention output [T, heads x head_dim]."""
        if self._updates(layer, "o_proj"):
            self._add(hidden, layer, "o_proj", attn)

    def add_gate_up(self, gate_up: np.ndarray, hidden: np.ndarray, layer: int, s_down: np.ndarray) -> None:
        """Into gate|up [T, 2 x intermediate], whose up half the backend divides by `s_down`."""
        if self._updates(layer, "gate_up"):
            self._add(gate_up, layer, "gate_up", hidden, self.norms.post_norms[layer], s_down)

    def add_down(self, hidden: np.ndarray, gate_up: np.ndarray, layer: int, s_down: np.ndarray) -> None:
        """Into the residual stream, from gate|up as add_gate_up left it."""
        if self._updates(layer, "down"):
            gate, up = np.split(gate_up[self.rows], 2, axis=1)
            sigmoid = 0.5 + 0.5 * np.tanh(0.5 * gate)  # no overflow for large |gate|, unlike 1 / (1 + exp(-gate))
            act = gate * sigmoid * (up * s_down)
            self._add(hidden, layer, "down", act, x_rows=np.arange(len(self.rows)))

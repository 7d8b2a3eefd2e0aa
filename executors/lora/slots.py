"""The adapters resident in a backend: a bounded pool of slots (S-LoRA's), each holding one adapter's updates
in the layout of the engine's fused projections, and a step's tokens grouped by slot.

The engine fuses q|k|v and gate|up into one matmul each, so an adapter's updates are kept per fused group:
the group's A matrices stacked, A_cat [in, r_q + r_k + r_v], and B_cat [r_total, width] with each module's
B (scaled) at its own columns, zero elsewhere. One shrink and one expand per (slot, layer, group) then
produce the delta of every targeted module at once, in the fused output's columns; the rows of a step are
grouped by slot first (Punica's SGMV: each adapter's weights are read once a step, however many of its
tokens run). Updates are float32 numpy: the CPU backends add them to their float32 (or bfloat16, rounded
as PEFT rounds) projection outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine_format import ModelSpec
from executors.lora.adapter import TARGETS, AdapterError, LoraAdapter, module_shape

# Fused projection -> the PEFT targets in it, in column order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class GroupUpdate:
    """One adapter's update of one fused projection of one layer: delta = x @ a @ b."""

    a: np.ndarray  # [in, r_total] float32
    b: np.ndarray  # [r_total, width] float32, scaling folded in

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return (x @ self.a) @ self.b


def _group_update(adapter: LoraAdapter, spec: ModelSpec, layer: int, targets: tuple[str, ...]) -> GroupUpdate | None:
    present = [(t, adapter.modules[layer, t]) for t in targets if (layer, t) in adapter.modules]
    if not present:
        return None
    widths = [module_shape(spec, t)[1] for t in targets]
    offsets = dict(zip(targets, np.cumsum([0, *widths[:-1]]).tolist(), strict=True))
    a = np.concatenate([m.a for _, m in present]).T.copy()
    b = np.zeros((a.shape[1], sum(widths)), np.float32)
    row = 0
    for target, module in present:
        col = offsets[target]
        b[row : row + module.rank, col : col + module.b.shape[0]] = module.b.T * module.scaling
        row += module.rank
    return GroupUpdate(a, b)


def group_updates(adapter: LoraAdapter, spec: ModelSpec) -> dict[tuple[int, str], GroupUpdate]:
    """Each (layer, fused projection) the adapter updates, in the fused layout (a slot's contents)."""
    updates = {}
    for layer in range(spec.num_layers):
        for group, targets in GROUPS.items():
            update = _group_update(adapter, spec, layer, targets)
            if update is not None:
                updates[layer, group] = update
    return updates


@dataclass(frozen=True)
class TokenGroups:
    """A step's tokens that run under an adapter, grouped by slot: (slot, flat token rows) pairs."""

    groups: tuple[tuple[int, np.ndarray], ...]

    @classmethod
    def of(cls, lora_slots: Sequence[int | None], lengths: np.ndarray) -> TokenGroups:
        """From each chunk's slot (None: the base model) and token count, in flat order."""
        starts = np.cumsum(lengths) - lengths
        rows: dict[int, list[np.ndarray]] = {}
        for slot, start, length in zip(lora_slots, starts, lengths, strict=True):
            if slot is not None:
                rows.setdefault(slot, []).append(np.arange(start, start + length))
        return cls(tuple((slot, np.concatenate(parts)) for slot, parts in rows.items()))

    def __bool__(self) -> bool:
        return bool(self.groups)


class LoraSlots:
    """`num_slots` adapters resident at once; `targets`: the projections this backend can update."""

    def __init__(self, spec: ModelSpec, num_slots: int, backend: str, targets: tuple[str, ...] = TARGETS) -> None:
        self.spec = spec
        self.backend = backend
        self.targets = targets
        self.names: list[str | None] = [None] * num_slots
        self._updates: list[dict[tuple[int, str], GroupUpdate]] = [{} for _ in range(num_slots)]

    @property
    def num_slots(self) -> int:
        return len(self.names)

    def check(self, adapter: LoraAdapter) -> None:
        """AdapterError if the adapter targets a projection this backend does not update."""
        missing = [t for t in adapter.targets if t not in self.targets]
        if missing:
            raise AdapterError(
                adapter.name,
                "target_modules",
                f"the {self.backend} backend applies LoRA to {list(self.targets)}, not {missing}: serve it with "
                "--backend cpu-bf16",
            )

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        self.check(adapter)
        self._updates[slot] = group_updates(adapter, self.spec)
        self.names[slot] = adapter.name

    def clear(self, slot: int) -> None:
        self._updates[slot] = {}
        self.names[slot] = None

    def updates_group(self, tokens: TokenGroups, layer: int, group: str) -> bool:
        """Whether some adapter of the step updates this projection."""
        return any((layer, group) in self._updates[slot] for slot, _ in tokens.groups)

    def deltas(self, tokens: TokenGroups, layer: int, group: str, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(rows, delta [len(rows), width]) for each slot of the step that updates this projection; `x` is
        the projection's float32 input, every row of the step."""
        out = []
        for slot, rows in tokens.groups:
            update = self._updates[slot].get((layer, group))
            if update is not None:
                out.append((rows, update(x[rows])))
        return out

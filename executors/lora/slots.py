"""The adapters resident in a backend: a bounded pool of slots (S-LoRA's), each holding one adapter's updates
in the layout of the engine's fused projections, and a step's tokens under an adapter with their slots.

The engine fuses q|k|v and gate|up into one matmul each, so an adapter's updates are kept per fused group:
the group's A matrices side by side, A_cat [in, r_q + r_k + r_v], and each module's B (scaled) as a block with
its first column in the fused output. One shrink and one expand per row then produce the delta of every
targeted module at once. A step's LoRA rows, whatever their slots, go through one C kernel call per (layer,
fused projection) (executors/kernels/lora_ops.h: Punica's SGMV); the slot-by-slot numpy form took ~1,000 small
calls a step (a 16-row decode step over 8 adapters: 55 ms against 21.5 without them; the kernel: ~26).
The matrices are float32, or float16 where a backend's tolerance allows (`half`); the sums are float32, and the
CPU backends add them to their float32 (or bfloat16, rounded as PEFT rounds) projection outputs.
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
    """One adapter's update of one fused projection of one layer, per row: (x @ a) split by module, each part
    times its block, at its columns."""

    a: np.ndarray  # [in, r_total] float32: the modules' A matrices side by side
    blocks: tuple[tuple[np.ndarray, int], ...]  # each module's B [r_m, w_m] (scaling folded in) and first column
    width: int  # the fused projection's columns

    def astype(self, dtype: type) -> GroupUpdate:
        return GroupUpdate(self.a.astype(dtype), tuple((b.astype(dtype), col) for b, col in self.blocks), self.width)

    @property
    def b(self) -> np.ndarray:
        """[r_total, width]: the blocks on a zero matrix (the GPU kernel's layout, plugins_cuda/lora.py)."""
        b = np.zeros((self.a.shape[1], self.width), np.float32)
        row = 0
        for block, col in self.blocks:
            b[row : row + block.shape[0], col : col + block.shape[1]] = block
            row += block.shape[0]
        return b


def _group_update(adapter: LoraAdapter, spec: ModelSpec, layer: int, targets: tuple[str, ...]) -> GroupUpdate | None:
    present = [(t, adapter.modules[layer, t]) for t in targets if (layer, t) in adapter.modules]
    if not present:
        return None
    widths = [module_shape(spec, t)[1] for t in targets]
    offsets = dict(zip(targets, np.cumsum([0, *widths[:-1]]).tolist(), strict=True))
    a = np.ascontiguousarray(np.concatenate([m.a for _, m in present]).T, np.float32)
    blocks = tuple((np.ascontiguousarray(m.b.T * m.scaling, np.float32), offsets[target]) for target, m in present)
    return GroupUpdate(a, blocks, sum(widths))


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
class Rope:
    """RoPE on an update's first `columns` columns, head by head, at each row of x's position: the `cpu` backend
    adds the q and k updates to q and k its segments already rotated (RoPE is linear)."""

    cos: np.ndarray  # float32 [max_positions, head_dim], the rotate-half form: x * cos + [x2, x1] * sin
    sin: np.ndarray  # its first half negated
    positions: np.ndarray  # int64 [T]: each row of x's position
    columns: int


@dataclass(frozen=True)
class LoraRows:
    """A step's tokens that run under an adapter: their flat rows (ascending) and each one's slot."""

    rows: np.ndarray  # [n] int64
    slots: np.ndarray  # [n] int32

    @classmethod
    def of(cls, lora_slots: Sequence[int | None], lengths: np.ndarray) -> LoraRows:
        """From each chunk's slot (None: the base model) and token count, in flat order."""
        slot_of_token = np.repeat(np.array([-1 if s is None else s for s in lora_slots], np.int32), lengths)
        rows = np.flatnonzero(slot_of_token >= 0)
        return cls(rows, np.ascontiguousarray(slot_of_token[rows]))

    def __bool__(self) -> bool:
        return bool(self.rows.size)


NO_ROWS = LoraRows(np.zeros(0, np.int64), np.zeros(0, np.int32))


_NO_NORM = np.zeros(0, np.float32)  # the kernel's "no norm"
_NO_ROPE = (np.zeros(0, np.int64), _NO_NORM, _NO_NORM, 0, 0)  # and its "no RoPE": no positions
MODULES = 3  # blocks per fused projection at most (q, k, v): executors/kernels/lora_ops.h's LORA_MODULES


class _GroupTable:
    """One (layer, fused projection)'s matrices in every slot, as the kernel takes them: addresses and shapes
    (0 where a slot's adapter does not update it). The arrays they point to stay referenced by the slot."""

    def __init__(self, num_slots: int, width: int) -> None:
        self.width = width
        self.a_ptrs, self.ranks = np.zeros(num_slots, np.int64), np.zeros(num_slots, np.int64)
        self.b_ptrs, self.b_ranks, self.b_cols, self.b_widths = (
            np.zeros((num_slots, MODULES), np.int64) for _ in range(4)
        )
        self.kernel_args = (self.a_ptrs, self.ranks, self.b_ptrs, self.b_ranks, self.b_cols, self.b_widths)

    def set(self, slot: int, update: GroupUpdate | None) -> None:
        self.a_ptrs[slot] = 0 if update is None else update.a.ctypes.data
        self.ranks[slot] = 0 if update is None else update.a.shape[1]
        for table in (self.b_ptrs, self.b_ranks, self.b_cols, self.b_widths):
            table[slot] = 0
        for m, (block, col) in enumerate(update.blocks if update is not None else ()):
            self.b_ptrs[slot, m], self.b_cols[slot, m] = block.ctypes.data, col
            self.b_ranks[slot, m], self.b_widths[slot, m] = block.shape


class LoraSlots:
    """`num_slots` adapters resident at once; `targets`: the projections this backend can update."""

    def __init__(
        self, spec: ModelSpec, num_slots: int, backend: str, targets: tuple[str, ...] = TARGETS, half: bool = False
    ) -> None:
        """`half`: keep the matrices as float16 (half the bytes a step reads; float32 sums), for backends whose
        tolerance allows it."""
        self.spec = spec
        self.backend = backend
        self.targets = targets
        self.half = half
        self.threads = 1  # the kernel's OpenMP threads: the backend's
        self.names: list[str | None] = [None] * num_slots
        self._updates: list[dict[tuple[int, str], GroupUpdate]] = [{} for _ in range(num_slots)]
        self._tables: dict[tuple[int, str], _GroupTable] = {}

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
                "--backend cpu-bf16 or cpu-int8",
            )

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        self.check(adapter)
        self._set(slot, group_updates(adapter, self.spec))
        self.names[slot] = adapter.name

    def clear(self, slot: int) -> None:
        self._set(slot, {})
        self.names[slot] = None

    def updates_group(self, rows: LoraRows, layer: int, group: str) -> bool:
        """Whether some adapter of the step updates this projection."""
        table = self._tables.get((layer, group))
        return table is not None and bool(table.ranks[rows.slots].any())

    def groups(self, rows: LoraRows) -> frozenset[tuple[int, str]]:
        """The (layer, fused projection)s some adapter of the step updates (updates_group's, for a whole step)."""
        return frozenset().union(*(self._updates[s] for s in np.unique(rows.slots).tolist()))

    def delta(
        self,
        rows: LoraRows,
        layer: int,
        group: str,
        x: np.ndarray,
        norm: np.ndarray | None = None,
        eps: float = 0.0,
        x_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Each LoRA row's update of this projection [n, width] float32 (zeros where its adapter has none); the
        arguments are add()'s."""
        out = np.zeros((rows.slots.size, self._tables[layer, group].width), np.float32)
        self.add(rows, layer, group, x, (out,), norm, eps, x_rows, out_rows=np.arange(rows.slots.size))
        return out

    def add(
        self,
        rows: LoraRows,
        layer: int,
        group: str,
        x: np.ndarray,
        outputs: tuple[np.ndarray, ...],
        norm: np.ndarray | None = None,
        eps: float = 0.0,
        x_rows: np.ndarray | None = None,
        rope: Rope | None = None,
        out_rows: np.ndarray | None = None,
    ) -> None:
        """Add each LoRA row's update of this projection, in one kernel call for every slot of the step, to its
        row rows.rows[i] (or out_rows[i]) of the projection's output: `outputs`, C-contiguous float32 [T, w] arrays
        side by side in column order (one [T, width], or the `cpu` backend's q, k and v), or the residual stream
        for o_proj and down. The input is row rows.rows[i] (or x_rows[i]) of `x` (float32 [T, in], read in place),
        RMS-normalized with `norm` and `eps` first when `norm` is given; `rope` rotates the update first."""
        from executors.cpu_attention import kernel_module  # loaded by the backend by now, under its OpenMP policy

        t = self._tables[layer, group]
        x = np.ascontiguousarray(x, np.float32)
        weight = _NO_NORM if norm is None else np.ascontiguousarray(norm, np.float32)
        kernel_module().lora_sgmv(
            x,
            x.shape[1],
            x.shape[1],
            rows.rows if x_rows is None else x_rows,
            rows.slots,
            weight,
            eps,
            *t.kernel_args,
            t.width,
            self.threads,
            int(self.half),
            outputs,
            rows.rows if out_rows is None else out_rows,
            *(_NO_ROPE if rope is None else (rope.positions, rope.cos, rope.sin, rope.cos.shape[1], rope.columns)),
        )

    def _set(self, slot: int, updates: dict[tuple[int, str], GroupUpdate]) -> None:
        """A slot's contents, and its column of every group's table (the arrays stay referenced by _updates)."""
        if self.half:
            updates = {key: update.astype(np.float16) for key, update in updates.items()}
        self._updates[slot] = updates
        for key, update in updates.items():
            if key not in self._tables:
                self._tables[key] = _GroupTable(self.num_slots, update.width)
        for key, table in self._tables.items():
            table.set(slot, updates.get(key))

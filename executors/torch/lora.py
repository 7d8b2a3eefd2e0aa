"""LoRA adapters in the torch backend: the slots' updates kept on the device in the layout of the SGMV kernels
(plugins_cuda/lora.py), and a step's chunks as segments of one slot.

Pools, per (layer, fused projection): A [S, R_g, in] and B [S, width, R_g] in the compute dtype. Slot s holds its
adapter's GroupUpdate (executors/lora/slots.py) transposed and zero-padded to R_g = max_rank x the group's modules
(an adapter of q alone at rank r fills r of the qkv pool's 3 x max_rank rows), so one pool holds adapters of any
ranks and targets and the kernels compile once per group shape, not per adapter. Scaling is folded into B: the
kernels' scaling vector is ones.

Allocation is on demand: a (layer, group)'s pools are allocated by the first adapter loaded that updates it and
then kept (a slot's rows are zeroed when its adapter leaves). Why: at max rank the MLP's pools are about two thirds
of the bytes (gate|up and down are the widest projections), and attention-only adapters, the common case, then
reserve none of it. The cost: a load that allocates can run out of memory there, not at start.

A step's chunks become segments (contiguous runs of one slot in the flat token order; base chunks are slot -1),
packed on the host and sent in the step's one host -> device copy, in steps that have a LoRA chunk only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from engine_format import ModelSpec
from executors.base import SequenceChunk
from executors.lora import GROUPS, TARGETS, AdapterError, GroupUpdate, LoraAdapter, LoraSlots
from executors.lora.adapter import module_shape
from executors.lora.slots import group_updates

Key = tuple[int, str]  # (layer, fused projection: a GROUPS key)


@dataclass(frozen=True)
class GroupPool:
    a: torch.Tensor  # [S, R_g, in]
    b: torch.Tensor  # [S, width, R_g]


class DeviceLoraSlots(LoraSlots):
    """LoraSlots whose updates live in device pools (the torch backend's); the host-side `deltas` of the CPU
    backends are not kept."""

    def __init__(
        self, spec: ModelSpec, num_slots: int, backend: str, max_rank: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__(spec, num_slots, backend, TARGETS)
        self.max_rank, self.device, self.dtype = max_rank, device, dtype
        self.pools: dict[Key, GroupPool] = {}
        self.scaling = torch.ones(num_slots, dtype=torch.float32, device=device)  # folded into B
        self.held: list[frozenset[Key]] = [frozenset()] * num_slots  # the (layer, group)s each slot updates

    def check(self, adapter: LoraAdapter) -> None:
        super().check(adapter)
        if adapter.rank > self.max_rank:
            raise AdapterError(
                adapter.name,
                "r",
                f"rank {adapter.rank} is above the {self.backend} backend's pool rank {self.max_rank}",
            )

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        self.check(adapter)
        updates = group_updates(adapter, self.spec)
        for key in self.held[slot] - updates.keys():  # the previous adapter's rows that this one leaves
            self._zero(slot, key)
        for key, update in updates.items():
            self._write(slot, key, update)
        self.held[slot] = frozenset(updates)
        self.names[slot] = adapter.name

    def clear(self, slot: int) -> None:
        for key in self.held[slot]:  # a step runs a group's kernels for every slot in it: no stale rows
            self._zero(slot, key)
        self.held[slot] = frozenset()
        super().clear(slot)

    def _pool(self, key: Key) -> GroupPool:
        pool = self.pools.get(key)
        if pool is None:
            targets = GROUPS[key[1]]
            fan_in, width = module_shape(self.spec, targets[0])[0], sum(module_shape(self.spec, t)[1] for t in targets)
            rank, slots = self.max_rank * len(targets), self.num_slots
            a = torch.zeros(slots, rank, fan_in, device=self.device, dtype=self.dtype)
            pool = self.pools[key] = GroupPool(a, torch.zeros(slots, width, rank, device=self.device, dtype=self.dtype))
        return pool

    def _write(self, slot: int, key: Key, update: GroupUpdate) -> None:
        """The slot's rows: A^T and B^T, zero past the update's rank (the previous adapter's may be wider)."""
        pool, rank = self._pool(key), update.a.shape[1]
        a = torch.zeros(pool.a.shape[1:], dtype=torch.float32)
        a[:rank] = torch.from_numpy(update.a.T)
        b = torch.zeros(pool.b.shape[1:], dtype=torch.float32)
        b[:, :rank] = torch.from_numpy(update.b.T)
        pool.a[slot].copy_(a)  # stream-ordered: after the steps already launched
        pool.b[slot].copy_(b)

    def _zero(self, slot: int, key: Key) -> None:
        pool = self.pools[key]
        pool.a[slot].zero_()
        pool.b[slot].zero_()


@dataclass(frozen=True)
class LoraHostStep:
    """A step's segments on the host, and the (layer, group)s some adapter of the step updates."""

    packed: np.ndarray  # int64: segment starts [G + 1], then segment slots [G]
    segments: int  # G
    max_len: int  # the longest adapter segment (sizes the kernels' grid without a device read)
    updated: frozenset[Key]

    @classmethod
    def pack(cls, chunks: Sequence[SequenceChunk], slots: DeviceLoraSlots) -> LoraHostStep | None:
        """None where no chunk runs under an adapter (a base-model step). ValueError for a chunk naming a slot
        outside the pool or one holding no adapter: the kernels index the pools with it unchecked."""
        chosen = [-1 if c.lora_slot is None else c.lora_slot for c in chunks]
        if max(chosen) < 0:
            return None
        for i, slot in enumerate(chosen):
            if slot != -1 and not (0 <= slot < slots.num_slots and slots.names[slot] is not None):
                raise ValueError(f"chunk {i}: LoRA slot {slot} holds no adapter (slots: {slots.names})")
        per_chunk = np.array(chosen, np.int64)
        ends = np.cumsum([len(c.token_ids) for c in chunks])
        last = np.flatnonzero(np.append(per_chunk[1:] != per_chunk[:-1], True))  # each run's last chunk
        run_slots, run_ends = per_chunk[last], ends[last]
        run_starts = np.append(0, run_ends[:-1])
        kept = np.flatnonzero(run_slots >= 0)
        lo, hi = int(kept[0]), int(kept[-1]) + 1  # base runs at either end dropped; between adapters they stay
        starts = np.append(run_starts[lo:hi], run_ends[hi - 1])
        updated = frozenset().union(*(slots.held[s] for s in set(run_slots[kept].tolist())))
        max_len = int((run_ends - run_starts)[kept].max())
        return cls(np.concatenate([starts, run_slots[lo:hi]]).astype(np.int64), hi - lo, max_len, updated)

    def on_device(self, packed: torch.Tensor, slots: DeviceLoraSlots, kernels: ModuleType) -> LoraStep:
        """`packed`: this step's `packed`, copied to the device. `kernels`: plugins_cuda.lora."""
        starts, segment_slots = packed.to(torch.int32).split([self.segments + 1, self.segments])
        return LoraStep(starts, segment_slots, self.max_len, self.updated, slots, kernels)


@dataclass(frozen=True)
class LoraStep:
    """A step's adapters on the device: Decoder.forward adds their updates to each projection's output."""

    starts: torch.Tensor  # [G + 1] int32
    segment_slots: torch.Tensor  # [G] int32, -1: a base run between adapter runs (skipped by the kernels)
    max_len: int
    updated: frozenset[Key]
    slots: DeviceLoraSlots
    kernels: ModuleType

    def updates(self, layer: int, group: str) -> bool:
        return (layer, group) in self.updated

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each segment's adapter update of x (the projection's input), in place; nothing where no adapter of
        the step updates this projection."""
        if (layer, group) in self.updated:
            pool = self.slots.pools[layer, group]
            self.kernels.lora_apply(
                x, y, pool.a, pool.b, self.slots.scaling, self.starts, self.segment_slots, max_segment_len=self.max_len
            )

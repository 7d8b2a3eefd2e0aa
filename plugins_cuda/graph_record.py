"""A CPU stand-in for CUDA-graph capture and replay of the interpreted Triton launches.

Why: a CUDA graph bakes each captured launch's pointers and scalars; replaying it after the
memory behind a pointer was freed, or moved by a reallocation (a cached workspace grown for a
bigger shape), is the "illegal memory access" that plain launches never show. No GPU here, so
`FakeGraph` applies the graph's rules to the launches the launchers make under the interpreter:

- capture: every `kernel[grid](...)` is recorded, not run (as stream capture does); every
  tensor an aten op allocates meanwhile is owned by the graph (the private memory pool: it
  lives as long as the graph); any other tensor a launch reads is the caller's, held here
  only by a weak reference to its base, with the base's address and size at capture;
- a host synchronization (`.item()`, a data-dependent `torch.equal`) during capture is an
  error, as it is under real capture;
- replay: each launch runs again on the recorded arguments, after checking that every
  caller-owned buffer is still alive at the same address and size; otherwise GraphHazard
  names the launch and the argument.

The real thing is checked on a GPU by plugins_cuda/graph_check.py (torch.cuda.CUDAGraph).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SYNCS = {"_local_scalar_dense", "equal", "is_nonzero"}


class GraphHazard(AssertionError):
    """A captured launch would read or write memory its graph does not keep valid."""


@dataclass
class _Buffer:
    """One tensor argument of a recorded launch: how to find its memory again at replay."""

    name: str
    ref: Any  # the base tensor (graph-owned) or a weakref.ref to it (caller-owned)
    owned: bool
    address: int  # storage address and size at capture
    nbytes: int
    view: tuple  # size, stride, storage offset, dtype

    def resolve(self, launch: str) -> torch.Tensor:
        base = self.ref if self.owned else self.ref()
        if base is None:
            raise GraphHazard(f"{launch}: {self.name} was freed after capture (the graph still points at it)")
        storage = base.untyped_storage()
        if (storage.data_ptr(), storage.nbytes()) != (self.address, self.nbytes):
            raise GraphHazard(f"{launch}: {self.name} moved or was resized after capture "
                              f"({self.nbytes} bytes at {self.address:#x} -> {storage.nbytes()} at "
                              f"{storage.data_ptr():#x})")  # fmt: skip
        size, stride, offset, dtype = self.view
        return torch.as_strided(base if base.dtype == dtype else base.view(dtype), size, stride, offset)


@dataclass
class _Launch:
    kernel: Any
    grid: tuple
    args: list
    kwargs: dict

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or getattr(getattr(self.kernel, "fn", None), "__name__", "?")


class _Allocations(TorchDispatchMode):
    """Marks every tensor an aten op returns on fresh storage as graph-owned; refuses syncs."""

    def __init__(self, graph: FakeGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCS:
            raise GraphHazard(f"host synchronization during capture: aten.{func.overloadpacket.__name__}")
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.graph.own(t)
        return out


class FakeGraph:
    """Record with `capture()`, run with `replay()` (as often as wanted, at any later time)."""

    def __init__(self) -> None:
        self.launches: list[_Launch] = []
        self._owned: dict[int, torch.Tensor] = {}  # storage address -> a tensor keeping it alive

    def own(self, tensor: torch.Tensor) -> None:
        self._owned.setdefault(tensor.untyped_storage().data_ptr(), tensor)

    @contextlib.contextmanager
    def capture(self) -> Iterator[FakeGraph]:
        from triton.runtime.interpreter import InterpretedFunction

        own = InterpretedFunction.__dict__.get("__getitem__")  # else inherited from KernelInterface
        InterpretedFunction.__getitem__ = lambda fn, grid: lambda *a, **k: self._record(fn, grid, a, k)
        try:
            with _Allocations(self):
                yield self
        finally:
            if own is None:
                del InterpretedFunction.__getitem__
            else:
                InterpretedFunction.__getitem__ = own

    def _record(self, kernel, grid, args: tuple, kwargs: dict) -> None:
        if callable(grid):
            raise GraphHazard(f"{kernel}: a callable grid is evaluated per launch; a graph bakes one")
        launch = _Launch(kernel, tuple(grid), [], {})
        names = list(getattr(kernel, "arg_names", ())) + [f"argument {i}" for i in range(len(args))]
        launch.args = [self._buffer(names[i], a) for i, a in enumerate(args)]
        launch.kwargs = {k: self._buffer(k, v) for k, v in kwargs.items()}
        self.launches.append(launch)

    def _buffer(self, name: str, value):
        if not isinstance(value, torch.Tensor):
            return value
        base = value._base if value._base is not None else value
        storage = base.untyped_storage()
        owned = storage.data_ptr() in self._owned
        view = (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
        return _Buffer(name, base if owned else weakref.ref(base), owned, storage.data_ptr(), storage.nbytes(), view)

    def replay(self) -> None:
        for launch in self.launches:
            where = f"{launch.name}{list(launch.grid)}"
            args = [a.resolve(where) if isinstance(a, _Buffer) else a for a in launch.args]
            kwargs = {k: v.resolve(where) if isinstance(v, _Buffer) else v for k, v in launch.kwargs.items()}
            launch.kernel[launch.grid](*args, **kwargs)

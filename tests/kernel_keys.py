"""Which compiled variant each Triton launch needs, computed on the CPU as Triton's JIT computes it.

Triton compiles a kernel once per *specialization key*: the constexpr values, the launch options
(num_warps, num_stages), and for every other argument its type plus what the JIT specializes on (an
integer equal to 1 becomes a constant, one divisible by 16 is marked so, a pointer 16-byte aligned is
marked so), unless the kernel lists the argument in `do_not_specialize` /
`do_not_specialize_on_alignment`. `record_keys()` wraps the interpreter's launch (TRITON_INTERPRET=1) and
collects each launch's key with Triton's own `native_specialize_impl`, so a test can assert that serving
launches no key the warm-up did not compile.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

LAUNCH_OPTIONS = ("num_warps", "num_stages")

Key = tuple  # (kernel name, ((argument, specialization), ...), launch options)


def launch_key(kernel, args: tuple, kwargs: dict) -> Key:
    """The JIT's specialization key of `kernel[grid](*args, **kwargs)` (kernel: an InterpretedFunction)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    fn = kernel.fn
    params = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    no_value = set(kernel.kwargs.get("do_not_specialize") or ())
    no_align = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    parts = []
    for index, (name, param) in enumerate(params.items()):
        value = bound.arguments.get(name, param.default)
        if "constexpr" in str(param.annotation):
            parts.append((name, ("constexpr", value)))
            continue
        specialize = name not in no_value and index not in no_value
        align = name not in no_align and index not in no_align
        parts.append((name, tuple(native_specialize_impl(BaseBackend, value, False, specialize, align))))
    options = tuple((k, kwargs.get(k)) for k in LAUNCH_OPTIONS)
    return (fn.__name__, tuple(parts), options)


@contextlib.contextmanager
def record_keys() -> Iterator[set[Key]]:
    """Every interpreted launch's key inside the block, in the yielded set."""
    from triton.runtime.interpreter import InterpretedFunction

    keys: set[Key] = set()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        keys.add(launch_key(self, args, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield keys
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]


def describe(keys: set[Key]) -> list[str]:
    """One readable line a key: the kernel and what each specialized argument is specialized as ("D": a
    multiple of 16 / 16-byte aligned; "": neither; a constexpr's value)."""
    lines = []
    for name, parts, options in sorted(keys, key=repr):
        shown = [f"{arg}={spec[1]!r}" for arg, spec in parts if spec[1] is not None]
        lines.append(f"{name}({', '.join(shown)}) {dict(options)}")
    return lines

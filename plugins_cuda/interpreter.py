"""Whether Triton's interpreter (TRITON_INTERPRET=1, how every kernel is verified on CPU) can run
with the installed numpy.

Why: numpy 2.4 turned `int()` of a 1-element array into a TypeError ("only 0-dimensional arrays
can be converted to Python scalars"), and Triton's interpreter before 3.7 calls it on every
scalar tensor it indexes with (`tensor.__index__`; fixed upstream by triton-lang/triton#9172,
which Triton 3.9, this project's pin, has). The GPU image carries Triton 3.6 with numpy 2.5:
there, interpreter runs are refused with this reason instead of failing inside a kernel.
"""

from __future__ import annotations

FIXED_TRITON = (3, 7)
BREAKING_NUMPY = (2, 4)


def _version(text: str) -> tuple[int, int]:
    major, minor = [*text.split("+")[0].split("."), "0"][:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """None when the interpreter works with this numpy, else why not (and the fix). Reads the
    installed versions without importing triton: triton.language's own jit functions are built
    interpreted or not when triton is first imported, so a caller may still set TRITON_INTERPRET."""
    if triton_version is None or numpy_version is None:
        from importlib.metadata import version

        triton_version, numpy_version = version("triton"), version("numpy")
    if _version(triton_version) < FIXED_TRITON and _version(numpy_version) >= BREAKING_NUMPY:
        return (
            f"Triton {triton_version}'s interpreter fails with numpy {numpy_version} (only 0-dimensional arrays can "
            "be converted to Python scalars): install numpy<2.4 for interpreter runs, or Triton >= 3.7"
        )
    return None

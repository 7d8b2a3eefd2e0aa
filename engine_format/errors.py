"""The errors a reader of an engine directory raises (their own module: config.py and verify.py both raise them)."""

from __future__ import annotations


class EngineLoadError(Exception):
    """The engine directory is missing, incomplete or from an incompatible build."""


class EngineIntegrityError(EngineLoadError):
    """The engine's files do not match the SHA-256 digests its manifest records (engine_format/verify.py).

    A subclass of EngineLoadError, so every caller that already reports a load failure (trtserve
    generate, the Triton model, the Python API) reports this one the same way."""

"""The engine format: the one contract between the builder, calibration and the runtime.

A leaf package (it imports no other trtserve package): file names (files.py), the decoder
spec (model_spec.py), the manifest schema with its version and TensorRT limits (config.py),
the serving-time check of the files against the manifest's digests (verify.py, digests.py),
and the step interface every graph and backend implements (INTERFACE.md).
"""

from engine_format.config import (
    FORMAT,
    FORMAT_VERSION,
    TARGETS,
    EngineConfig,
    EngineLoadError,
    TensorRTLimits,
    ceil_div,
)
from engine_format.errors import EngineIntegrityError
from engine_format.model_spec import ModelSpec

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "TARGETS",
    "EngineConfig",
    "EngineIntegrityError",
    "EngineLoadError",
    "ModelSpec",
    "TensorRTLimits",
    "ceil_div",
]

"""ONNX Runtime sessions for the backends, all sharing one process-wide thread pool.

The CPU backend runs one session per segment; with per-session pools each would own its
own worker threads, fighting over the same cores. The global pool must be set before the
first session of the process exists, so every session trtserve makes goes through here.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnxruntime as ort

from runtime.engine_config import EngineLoadError

_pool_threads: int | None = None


def create_session(path: Path, threads: int | None = None) -> ort.InferenceSession:
    """A CPU session on the shared pool (sized by the first caller: `threads` or all cores)."""
    global _pool_threads
    if _pool_threads is None:
        _pool_threads = threads or os.cpu_count() or 1
        ort.capi._pybind_state.set_global_thread_pool_sizes(_pool_threads, 1)
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types for bad graphs
        raise EngineLoadError(f"ONNX Runtime could not load {path.name}: {exc}") from None

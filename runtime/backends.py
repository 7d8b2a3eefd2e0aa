"""Choose the engine backend for an engine directory."""

from __future__ import annotations

import dataclasses

from runtime.backend import EngineBackend
from runtime.engine_config import EngineConfig, EngineLoadError


def create_backend(
    config: EngineConfig, num_blocks: int | None = None, threads: int | None = None, kind: str | None = None
) -> EngineBackend:
    """kind: "cpu" (segments + paged-attention kernel; float32 engines), "graph" (the whole
    portable graph on ONNX Runtime; any dtype), "plugin" (the TensorRT plugin graph, its
    plugin ops run through their reference bodies), "tensorrt" (the compiled plan on a GPU; the
    default for engines built with --backend tensorrt). Default otherwise: cpu when the engine
    has segments."""
    if config.backend not in ("onnxruntime-cpu", "tensorrt"):
        raise EngineLoadError(f"engine built for backend {config.backend!r}; this runtime has onnxruntime-cpu")
    if kind == "tensorrt" or (kind is None and config.backend == "tensorrt"):
        from runtime.trt_backend import TrtBackend

        return TrtBackend(config, num_blocks)
    kind = kind or ("cpu" if config.has_cpu_segments else "graph")
    if kind == "cpu":
        from runtime.ort_cpu_backend import OrtCpuBackend

        return OrtCpuBackend(config, num_blocks, threads)
    if kind in ("graph", "plugin"):
        from runtime.ort_graph_backend import OrtGraphBackend

        if kind == "plugin":
            from builder.plugin_graph import PLUGIN_FILE

            config = dataclasses.replace(config, graph_file=PLUGIN_FILE)
        return OrtGraphBackend(config, num_blocks, threads, cover_step=kind == "plugin")
    raise ValueError(f"backend kind must be 'cpu', 'graph', 'plugin' or 'tensorrt' (got {kind!r})")

"""Engine backends: the executors of one engine step (`EngineBackend.step`, see base.py).

One vocabulary: an engine's *target* (engine_format.TARGETS) is what it was compiled for;
a *backend* (BACKENDS) is what runs it in this process:
- "cpu": the graph segments on ONNX Runtime with trtserve's paged-attention kernel between
  them (float32 engines; the default where the engine has segments);
- "graph": the whole portable graph on ONNX Runtime (any dtype);
- "plugin": the TensorRT plugin graph on ONNX Runtime, plugin ops through their reference bodies;
- "tensorrt": the compiled plan on a GPU (the default for target "tensorrt").
"""

from __future__ import annotations

from engine_format import EngineConfig
from engine_format.files import PLUGIN_GRAPH_FILE
from runtime.backends.base import EngineBackend

BACKENDS = ("cpu", "graph", "plugin", "tensorrt")


def default_backend(config: EngineConfig) -> str:
    if config.target == "tensorrt":
        return "tensorrt"
    return "cpu" if config.has_cpu_segments else "graph"


def create_backend(
    config: EngineConfig, num_blocks: int | None = None, threads: int | None = None, kind: str | None = None
) -> EngineBackend:
    """The backend `kind` (one of BACKENDS; default: default_backend) over `num_blocks` KV blocks."""
    kind = kind or default_backend(config)
    if kind == "tensorrt":
        from runtime.backends.tensorrt import TrtBackend  # imports TensorRT and CUDA: GPU machines only

        return TrtBackend(config, num_blocks)
    if kind == "cpu":
        from runtime.backends.ort_cpu import OrtCpuBackend  # loads the kernel, which sets the OpenMP policy

        return OrtCpuBackend(config, num_blocks, threads)
    if kind in ("graph", "plugin"):
        from runtime.backends.ort_graph import OrtGraphBackend

        if kind == "plugin":
            config = config.with_graph(PLUGIN_GRAPH_FILE)
        return OrtGraphBackend(config, num_blocks, threads, cover_step=kind == "plugin")
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {kind!r})")

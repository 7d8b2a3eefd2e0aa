"""ONNX Runtime sessions for the backends.

The CPU backend alternates ONNX Runtime runs with its own OpenMP kernel on the same cores,
so ORT's worker threads must not spin-wait between runs (they would steal the cores the
kernel needs); the kernel's OpenMP threads sleep likewise (see paged_attention.py).
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from engine_format import EngineLoadError
from executors.cpus import usable_cpus


def create_session(
    path: Path, threads: int | None = None, spinning: bool = True, quantization: str | None = None
) -> ort.InferenceSession:
    """`quantization`: the engine's method. INT4 weight DequantizeLinear + MatMul is fused by
    ORT into MatMulNBits (int4 weights, int8 compute). ORT CPU has no FP8 GEMM and its Q/DQ
    fusions mis-handle FP8 (they emit MatMulIntegerToFloat on float8 inputs), so FP8 engines
    run with Q/DQ fusions off: weight DequantizeLinear is constant-folded to fp32 and the
    activation Quantize/Dequantize pairs run as is, i.e. FP8 numerics at fp32 speed."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or usable_cpus()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Flush denormals to zero: AWQ-scaled INT4 engines produce denormal intermediates that cost
    # ~15% of single-stream decode speed (measured 60 -> 70 tok/s on SmolLM2; fp32 unchanged).
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    if quantization == "fp8":
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # Spin between a run's parallel sections, never after it returns: idle spinners would take the cores
    # from whatever runs next in the process (a draft engine's session between two target runs: an INT4
    # draft step measured 10 -> 18 ms, the target's verify 28 -> 51 ms), at no cost to one engine alone.
    options.add_session_config_entry("session.force_spinning_stop", "1")
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types for bad graphs
        raise EngineLoadError(f"ONNX Runtime could not load {path.name}: {exc}") from None

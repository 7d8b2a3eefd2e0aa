"""File names inside an engine directory (see INTERFACE.md beside this file)."""

from __future__ import annotations

MANIFEST = "manifest.json"
GRAPH_FILE = "model.onnx"  # the portable decoder over a padded [batch, step] batch
WEIGHTS_FILE = "model.onnx.data"  # every graph's external weights (one copy)
PLUGIN_GRAPH_FILE = "model.plugins.onnx"  # the graph rewritten to trtserve plugin ops
TRT_GRAPH_FILE = "model.trt.onnx"  # the plugin graph as TensorRT parses it (no reference bodies)
PLAN_FILE = "model.plan"  # the compiled TensorRT engine
SOURCE_CONFIG_FILE = "source_config.json"  # the checkpoint's Hugging Face config
GATE_REPORT_JSON = "gate_report.json"  # quantized engines: the quality gate's verdict
GATE_REPORT_MD = "gate_report.md"


def segment_file(index: int) -> str:
    """The CPU backend's graph segment `index` (0 .. num_layers)."""
    return f"segment.{index:02d}.onnx"

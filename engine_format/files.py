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
# float32 engines built where cpu-int8 is verified: max |input| per channel of every MatMul (numpy .npz keyed by
# the graph's MatMul names and "lm_head"), on calibration text; the backend's smoothing factors come from it.
ACTIVATION_RANGES_FILE = "activation_ranges.npz"
GATE_REPORT_MD = "gate_report.md"
# Listed in the manifest's files_sha256 but rewritten in place by `trtserve calibrate`
# (calibration/job.py) without updating the manifest; the runtime never reads them, so the
# serving-time hash check (verify.py) skips them.
REWRITABLE_FILES = frozenset({GATE_REPORT_JSON, GATE_REPORT_MD})
# Files the runtime may load as a graph, its external weights or a compiled plan. Graphs are loaded
# by the names the manifest gives and an ONNX graph pulls external data from any file beside it,
# so verify.py refuses one that files_sha256 does not list.
GRAPH_SUFFIXES = (".onnx", ".data", ".plan")


def segment_file(index: int) -> str:
    """The CPU backend's graph segment `index` (0 .. num_layers)."""
    return f"segment.{index:02d}.onnx"

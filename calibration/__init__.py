"""Post-training quantization (FP8, INT4-AWQ, INT4-RTN) behind a deploy quality gate.

data.py (packaged calibration / held-out text) -> activations.py (input statistics) ->
awq.py + gptq.py (INT4 scales and codes) / numerics.py (formats) -> quantize.py (per fused
linear, for the exporter) -> gate.py (quantized vs unquantized engine on ORT CPU) ->
job.py (re-gate an existing engine: `trtserve calibrate`).
"""

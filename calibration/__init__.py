"""Post-training quantization (FP8, INT4) behind a deploy quality gate. Not written yet."""

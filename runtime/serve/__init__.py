"""Serving trtserve engines behind NVIDIA Triton Inference Server (Python backend)."""

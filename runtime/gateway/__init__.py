"""OpenAI-compatible gateway in front of tritonserver."""

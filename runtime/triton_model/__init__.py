"""Code that runs inside the Triton Python-backend stub: the `llm` model's request parsing, responses, metrics and
lifecycle (model_repository/llm/1/model.py is the thin Triton-facing class)."""

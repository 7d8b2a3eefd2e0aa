"""The torch backend (backend kind "torch"): see backend.py. Imports torch and Triton."""

from executors.torch.backend import TorchBackend

__all__ = ["TorchBackend"]

"""The torch backend (backend kind "torch"): see backend.py. Imports torch and Triton."""

from runtime.backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]

"""GPU kernels in the Triton language, the implementations of trtserve's TensorRT plugins."""

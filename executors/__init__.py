"""Engine backends: the executors of one engine step (`EngineBackend.step`, see base.py).

One vocabulary: an engine's *target* (engine_format.TARGETS) is what it was compiled for;
a *backend* (BACKENDS) is what runs it in this process:
- "cpu": the graph segments on ONNX Runtime with trtserve's paged-attention kernel between
  them (float32 engines; the default where the engine has segments);
- "cpu-bf16": the same steps with the dense layers in bfloat16 on torch (oneDNN, AMX where the CPU
  has it) instead of ONNX Runtime (float32 engines; executors/torch_cpu.py);
- "cpu-int8": the same steps with int8 dense layers (W8A8, weights quantized at load) in trtserve's own
  kernel, on AVX512-VNNI or AVX2 (float32 engines; executors/cpu_int8.py);
- "graph": the whole portable graph on ONNX Runtime (any dtype);
- "plugin": the TensorRT plugin graph on ONNX Runtime, plugin ops through their reference bodies;
- "tensorrt": the compiled plan on a GPU (the default for target "tensorrt" where TensorRT is installed);
- "torch": the engine's weights in torch with trtserve's Triton kernels (executors/torch/):
  on CUDA the default where TensorRT is missing; on CPU the kernels run in Triton's interpreter.

A backend may also sample on its device (`DeviceSampling`, device_sampling.py): the engine then gets
token ids back instead of [batch, vocab] logits, sampled with the engine's own state and semantics
(sampling/: one package below the backends and the engine). factory.py picks and builds backends.
"""

from executors.base import EngineBackend, SequenceChunk
from executors.device_sampling import DeviceSampling
from executors.factory import BACKENDS, create_backend, cuda_present, default_backend, prepare_backend
from executors.sampling.state import DeviceSample

__all__ = [
    "BACKENDS",
    "DeviceSample",
    "DeviceSampling",
    "EngineBackend",
    "SequenceChunk",
    "create_backend",
    "cuda_present",
    "default_backend",
    "prepare_backend",
]

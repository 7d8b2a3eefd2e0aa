"""Token sampling: one semantics, two implementations, below both the backends and the engine.

- params.py: SamplingParams (validated against the request contract, engine_format/requests.py);
- state.py: SamplingState (a request's seeded stream and penalty counts), TokenLogprobs, SampleResult,
  DeviceSample (a step sampled by its backend);
- numpy_sampler.py: Sampler, on host logits (the engine's, and the speculative verifier's helpers), and
  prompt_logprobs (a prompt's tokens scored from its prefill's logits);
- torch_sampler.py: TorchSampler, the same steps over device tensors (the GPU backends' `step_sample`).
  Imports torch, so it is not imported here.

The engine and the backends share these types because sampling sits below both: a GPU backend samples
with the engine's own SamplingState and returns the engine's TokenLogprobs.
"""

from executors.sampling.numpy_sampler import Sampler, prompt_logprobs
from executors.sampling.params import MAX_LOGPROBS, SamplingParams
from executors.sampling.state import DeviceSample, SampleResult, SamplingState, TokenLogprobs

__all__ = [
    "MAX_LOGPROBS",
    "DeviceSample",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "SamplingState",
    "TokenLogprobs",
    "prompt_logprobs",
]

"""trtserve runtime: in-flight batching over compiled engines.

from runtime import LLM, SamplingParams
llm = LLM("engines/smollm2-135m")
[out] = llm.generate([[{"role": "user", "content": "Hi!"}]], SamplingParams(temperature=0))
"""

from runtime.async_llm import AsyncLLM
from runtime.engine.errors import InvalidRequest, Overloaded
from runtime.engine.llm_engine import EngineArgs, LLMEngine
from runtime.engine.outputs import CompletionOutput, RequestOutput
from runtime.engine.sampling_params import SamplingParams
from runtime.llm import LLM

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "InvalidRequest",
    "LLMEngine",
    "Overloaded",
    "RequestOutput",
    "SamplingParams",
]

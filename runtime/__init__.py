"""trtserve runtime: in-flight batching over compiled engines.

from runtime import LLM, SamplingParams
llm = LLM("engines/smollm2-135m")
[out] = llm.generate([[{"role": "user", "content": "Hi!"}]], SamplingParams(temperature=0))

The names below load on first use (PEP 562): the gateway and `trtserve serve`'s supervisor are
subpackages of `runtime` that run in processes of their own, without the engine, and importing
them must not load it (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncLLM": "runtime.async_llm",
    "ChatPrompt": "runtime.engine.chat_tools",
    "CompletionOutput": "runtime.engine.outputs",
    "EngineArgs": "runtime.engine.engine_args",
    "InvalidRequest": "runtime.engine.errors",
    "LLM": "runtime.llm",
    "LLMEngine": "runtime.engine.llm_engine",
    "Overloaded": "runtime.engine.errors",
    "RequestOutput": "runtime.engine.outputs",
    "SamplingParams": "executors.sampling.params",
    "freeze_startup_heap": "runtime.engine.heap",  # a long-lived serving process's, once it is up
}
__all__ = [
    "LLM",
    "AsyncLLM",
    "ChatPrompt",
    "CompletionOutput",
    "EngineArgs",
    "InvalidRequest",
    "LLMEngine",
    "Overloaded",
    "RequestOutput",
    "SamplingParams",
    "freeze_startup_heap",
]

if TYPE_CHECKING:
    from executors.sampling.params import SamplingParams
    from runtime.async_llm import AsyncLLM
    from runtime.engine.chat_tools import ChatPrompt
    from runtime.engine.engine_args import EngineArgs
    from runtime.engine.errors import InvalidRequest, Overloaded
    from runtime.engine.heap import freeze_startup_heap
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine.outputs import CompletionOutput, RequestOutput
    from runtime.llm import LLM


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups skip this function
    return value

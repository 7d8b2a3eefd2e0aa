"""Offline batch API: `LLM(engine_dir).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from executors.sampling import SamplingParams
from runtime.engine.admission import Prompt
from runtime.engine.chat_tools import ChatPrompt
from runtime.engine.llm_engine import EngineArgs, LLMEngine
from runtime.engine.outputs import CompletionOutput


class LLM:
    def __init__(self, engine_dir: str | Path, **engine_args: Any):
        """`engine_args`: EngineArgs' fields; `lora_modules` may also be a {name: adapter directory} mapping
        (a prompt then picks an adapter with SamplingParams(lora=name))."""
        loras = engine_args.get("lora_modules")
        if isinstance(loras, Mapping):
            engine_args["lora_modules"] = ",".join(f"{name}={path}" for name, path in loras.items()) or None
        self.engine = LLMEngine(engine_dir, EngineArgs(**engine_args))

    def close(self) -> None:
        """Write what the disk tier of the KV cache lacks (a later LLM finds it); nothing to do without one."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:  # a Hugging Face tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion with in-flight batching; results in input order.

        A prompt is text, a list of token ids, a list of chat messages
        ({"role": ..., "content": ...}), or a ChatPrompt (messages with tools); a bare string is one prompt.
        """
        # A prompt may itself be a sequence, so which one `prompts` is is decided at run time.
        single = isinstance(prompts, str | ChatPrompt) or _is_single_list_prompt(prompts)
        batch = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} SamplingParams for {len(batch)} prompts")
        engine, results = self.engine, {}
        try:
            for prompt, p in zip(batch, params, strict=True):
                request_id = engine.add_request(prompt, p)
                results[request_id] = CompletionOutput(request_id, engine.requests[request_id].prompt_token_ids)
            while any(c.finish_reason is None for c in results.values()):
                for delta in engine.step():
                    if delta.request_id in results:
                        results[delta.request_id].add(delta)
        except BaseException:
            for request_id in results:
                engine.abort(request_id)
            raise
        return list(results.values())


def _is_single_list_prompt(prompts: Sequence[Any]) -> bool:
    """A flat token-id list or a flat message list is one prompt, not a batch."""
    return bool(prompts) and all(isinstance(x, int | dict) for x in prompts)

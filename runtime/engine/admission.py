"""Admission: turn a user prompt and parameters into token ids, or a clear error.

Runs in the caller's thread (no engine state touched), so a bad request fails before it
is queued and never disturbs requests already running.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeGuard

from engine_format.requests import OPENAI_MAX_STRING, InvalidRequest
from executors.sampling import SamplingParams
from runtime.engine.chat_tools import ChatPrompt, check_messages, render

Prompt = str | Sequence[int] | Sequence[dict[str, Any]] | ChatPrompt  # text, token ids, chat messages (with tools)


def _all_messages(prompt: Sequence[object]) -> TypeGuard[Sequence[dict[str, Any]]]:
    return all(isinstance(m, dict) for m in prompt)


def _all_token_ids(prompt: Sequence[object]) -> TypeGuard[Sequence[int]]:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class Admission:
    def __init__(self, tokenizer: Any, vocab_size: int, max_seq_len: int, max_tokens_in_pool: int) -> None:
        """`tokenizer`: the engine's Hugging Face tokenizer."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_tokens_in_pool = max_tokens_in_pool

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, ChatPrompt):
            return self._chat(prompt.messages, prompt.tools)
        if not isinstance(prompt, Sequence) or not prompt:
            raise InvalidRequest("prompt", "must be a non-empty string, token id list or message list")
        if _all_messages(prompt):
            return self._chat(prompt)
        if not _all_token_ids(prompt):
            raise InvalidRequest("prompt", "a list prompt must hold only token ids or only messages")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("prompt", f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def _chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not messages:
            raise InvalidRequest("messages", "must not be empty")
        check_messages(messages)
        if not self.tokenizer.chat_template:
            raise InvalidRequest("messages", "this model has no chat template; send a text prompt")
        text = render(self.tokenizer, ChatPrompt(list(messages), tools))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids' text, special tokens kept (it encodes back to them); InvalidRequest naming an id outside the
        vocabulary."""
        return self.tokenizer.decode(self.tokenize(token_ids), skip_special_tokens=False)

    def max_prompt_chars(self, context_tokens: int, cap: int = OPENAI_MAX_STRING) -> int:
        """The most characters a prompt that fits `context_tokens` can have: no token decodes to more
        characters than its vocabulary string has (byte-level BPE: one per byte; SentencePiece: '▁' is
        one space), so a longer prompt can be refused before it is tokenized, never wrongly."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return min(cap, context_tokens * max(1, longest))

    def check_resume(self, resume_ids: Sequence[int], params: SamplingParams, stop_ids: frozenset[int]) -> None:
        """A resumed answer (resume_token_ids) must be one this request could have generated and not finished:
        ids in the vocabulary, none that stops it, shorter than max_tokens (`params` fitted)."""
        assert params.max_tokens is not None, "fit() first"
        if len(resume_ids) >= params.max_tokens:
            raise InvalidRequest(
                "resume_token_ids",
                f"{len(resume_ids)} tokens: the answer would have ended at max_tokens ({params.max_tokens})",
            )
        for token in resume_ids:
            if token >= self.vocab_size or token in stop_ids:
                why = "outside the vocabulary" if token >= self.vocab_size else "a stop token (the answer ended there)"
                raise InvalidRequest("resume_token_ids", f"token id {token} is {why}")

    def fit(self, prompt: Prompt, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """`params` with max_tokens None resolved to the room the context leaves (the one place where "no
        max_tokens means up to the end of the context" is decided, for every door); a request that could
        never run is rejected now rather than queued forever, naming the field to change."""
        past = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if past:
            raise InvalidRequest("logit_bias", f"token id {past[0]} outside the vocabulary [0, {self.vocab_size})")
        context = min(self.max_seq_len, self.max_tokens_in_pool)
        if len(prompt_ids) >= context:  # the prompt alone leaves no room: it is what to change
            chat = isinstance(prompt, ChatPrompt) or (isinstance(prompt, Sequence) and prompt and _all_messages(prompt))
            field = "messages" if chat else "prompt"
            limit = "the engine's max sequence length" if context == self.max_seq_len else "the KV cache"
            raise InvalidRequest(field, f"the prompt ({len(prompt_ids)} tokens) exceeds {limit} ({context} tokens, "
                                        "the first output token included)")  # fmt: skip
        if params.max_tokens is None:
            return replace(params, max_tokens=context - len(prompt_ids))
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_seq_len:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the engine's max sequence length ({self.max_seq_len})",
            )
        if total > self.max_tokens_in_pool:
            raise InvalidRequest(
                "max_tokens",
                f"prompt + max_tokens = {total} tokens exceeds the KV cache ({self.max_tokens_in_pool} tokens)",
            )
        return params

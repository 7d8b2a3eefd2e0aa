"""Tokenizer access for an engine directory (the build copies the tokenizer into it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine_format import EngineConfig


def load_tokenizer(engine_dir: str | Path) -> Any:
    """The engine's Hugging Face tokenizer (typed Any: the Auto class picks the concrete one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(engine_dir), local_files_only=True)


Decode = Callable[[Sequence[int], bool], str]  # (token ids, skip_special_tokens) -> text


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The tokenizer's Rust backend (a `tokenizers.Tokenizer`) where decoding through it gives
    `tokenizer.decode`'s text, else None: transformers' `decode` converts and checks its arguments in Python
    on every call, which cost 4-5x the decode itself (SmolLM2: ~9 vs ~49 us a token incrementally). Its only
    other work, clean_up_tokenization_spaces, keeps the slow path where a tokenizer asks for it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend


def decoder(tokenizer: Any) -> Decode:
    """`tokenizer.decode`, through its Rust backend directly where that gives the same text (rust_tokenizer)."""
    backend = rust_tokenizer(tokenizer)
    if backend is None:
        return lambda ids, skip: tokenizer.decode(list(ids), skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(list(ids), skip_special_tokens=skip)


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids for a user prompt; with `chat`, wrapped in the model's chat template."""
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("this model has no chat template: use --no-chat")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def stop_token_ids(tokenizer: Any, config: EngineConfig) -> tuple[int, ...]:
    ids = set(config.model.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

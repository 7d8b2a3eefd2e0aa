"""The detokenizer each request gets: the fastest one that still decodes exactly as `tokenizer.decode`.

Turning one token into text runs for every request every step, on the process that serves them: its cost
is per-token Python. Three ways, fastest first, chosen once per tokenizer (`Detokenizers`):
- **byte-level** (GPT-2-style BPE: Llama 3, Qwen, SmolLM2, Mistral Nemo): the tokenizer's decoder is
  `ByteLevel` alone, which maps every token to fixed bytes and decodes their concatenation as UTF-8 with
  replacement. So a token's text needs no decoder call: its bytes come from a table built once, and
  what is emitted is the pending bytes up to the last complete character (~0.5 us a token);
- **DecodeStream**, the tokenizers library's incremental decoder (the prefix/read-offset scheme in Rust,
  as vLLM's fast path), for other tokenizers with a Rust backend (SentencePiece-style decoders that
  strip or replace; ~2 us a token);
- the Python `IncrementalDetokenizer` where transformers' decode does more (clean_up_tokenization_spaces).
All three keep one contract (tests/test_detokenizer.py): the deltas' sum equals a one-shot decode of the
output (in the prompt's context, for decoders whose output depends on it), and no delta carries the U+FFFD
of a character split across tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from tokenizers import decoders

from runtime.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, prompt_context
from runtime.engine.tokenizer import rust_tokenizer

log = logging.getLogger(__name__)


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for the characters from U+0100 on, in byte order (the ByteLevel pre-tokenizer's alphabet)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def byte_level_tables(backend: Any) -> tuple[list[bytes], list[bytes]] | None:
    """Each token id's bytes as the ByteLevel decoder makes them (a token whose characters are not all in the
    byte map, such as an added token's, is its UTF-8), keeping and skipping special tokens; None unless the
    tokenizer decodes with ByteLevel alone."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    to_byte = _unicode_to_byte()
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    size = max(backend.get_vocab_size(with_added_tokens=True), max(special, default=-1) + 1)
    keep: list[bytes] = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None:  # a hole in the vocabulary: decode drops the id
            keep.append(b"")
        elif all(c in to_byte for c in token):
            keep.append(bytes(to_byte[c] for c in token))
        else:
            keep.append(token.encode())
    skip = [b"" if i in special else b for i, b in enumerate(keep)]
    return keep, skip


class ByteLevelDetokenizer:
    """Tokens' bytes appended to a pending buffer; the text up to its last complete character is emitted.
    Text ending in U+FFFD is held back (a character still split, or an invalid byte that later bytes may
    join to one U+FFFD) until more text or `flush`: the emitted pieces then always split the byte stream
    after a complete character, so their sum is the one-shot decode. The prompt plays no part: a ByteLevel
    token's text does not depend on the tokens before it."""

    def __init__(self, table: list[bytes]) -> None:
        self._table, self._pending = table, b""
        self.output_ids: list[int] = []
        self._text: list[str] = []

    @property
    def output_text(self) -> str:
        return "".join(self._text)

    def add(self, token_id: int) -> str:
        self.output_ids.append(token_id)
        table = self._table
        pending = self._pending + (table[token_id] if 0 <= token_id < len(table) else b"")
        text = pending.decode("utf-8", "replace")
        if not text or text[-1] == REPLACEMENT_CHAR:
            self._pending = pending
            return ""
        self._pending = b""
        self._text.append(text)
        return text

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", "replace"), b""
        if text:
            self._text.append(text)
        return text


class StreamDetokenizer:
    """IncrementalDetokenizer's contract over tokenizers' DecodeStream. DecodeStream never emits the U+FFFD of
    bytes that do not complete a character, which a one-shot decode does: `flush` decodes the output once in
    its context and releases what the stream held back (also after a reset, below)."""

    def __init__(self, backend: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._backend, self._skip_special = backend, skip_special_tokens
        self._context = prompt_context(
            lambda ids, skip: backend.decode(list(ids), skip_special_tokens=skip), prompt_token_ids, skip_special_tokens
        )
        self._stream = decoders.DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        self.output_ids: list[int] = []
        self._text: list[str] = []
        self._held_back = False  # ids since the last text: flush owes their text

    @property
    def output_text(self) -> str:
        return "".join(self._text)

    def add(self, token_id: int) -> str:
        self.output_ids.append(token_id)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers' "Invalid prefix" on non-monotonic byte output: restart, flush repairs
            log.debug("DecodeStream reset at token %d", token_id, exc_info=True)
            self._stream = decoders.DecodeStream(skip_special_tokens=self._skip_special)
            piece = None
        if piece is None:
            self._held_back = True
            return ""
        self._held_back = False
        self._text.append(piece)
        return piece

    def flush(self) -> str:
        if not self._held_back:
            return ""
        self._held_back = False
        skip = self._skip_special
        head = self._backend.decode(self._context, skip_special_tokens=skip)
        full = self._backend.decode(self._context + self.output_ids, skip_special_tokens=skip)
        if not full.startswith(head):  # the context does not decode apart: the output alone, as IncrementalDetokenizer
            full, head = self._backend.decode(self.output_ids, skip_special_tokens=skip), ""
        expected = full[len(head) :]
        emitted = self.output_text
        if not expected.startswith(emitted):  # not seen; said rather than sent wrong
            log.warning("streamed text diverged from the one-shot decode; %d characters held back", len(expected))
            return ""
        self._text.append(expected[len(emitted) :])
        return self._text[-1]


class Detokenizers:
    """Makes each request's detokenizer for one tokenizer, of the fastest kind it allows (built once: the
    byte table of a 49k vocabulary takes ~50 ms)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = rust_tokenizer(tokenizer)
        self._tables = None if self._backend is None else byte_level_tables(self._backend)
        self.kind = "byte-level" if self._tables else "stream" if self._backend is not None else "python"

    def __call__(self, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> Detokenizer:
        if self._tables is not None:
            return ByteLevelDetokenizer(self._tables[1] if skip_special_tokens else self._tables[0])
        if self._backend is not None:
            return StreamDetokenizer(self._backend, prompt_token_ids, skip_special_tokens)
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens)

"""Streaming detokenization and stop-string matching for one request.

Token ids arrive one at a time; the client must see text deltas whose concatenation equals a
one-shot `tokenizer.decode` of all generated ids, with no broken UTF-8 in between. Stop strings
are matched on that text (not on tokens), since a stop string rarely aligns with token edges.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from runtime.engine.tokenizer import Decode, decoder

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context: enough for tokenizers whose decode of a lone token
# differs from its decode in context (SentencePiece drops a leading space at sequence start).
PROMPT_CONTEXT_TOKENS = 5


LOGPROB_CONTEXT_TOKENS = 4  # tokens before a logprob's candidates, decoded with each


def prompt_context(decode: Decode, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The prompt's last tokens an incremental detokenizer decodes after (the prompt itself is never emitted).
    None of them when they end mid-character (a prompt of raw ids): the completion would be swallowed into them, so
    it is decoded without context, exactly as a full decode of the output."""
    context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    if context and decode(context, skip_special_tokens).endswith(REPLACEMENT_CHAR):
        return []
    return context


def candidate_texts(decode_ids: Decode, context: Sequence[int], candidates: Sequence[int]) -> dict[int, str]:
    """Each candidate token's text as it reads after `context` (the few tokens before it): alone, a
    SentencePiece token would lose its leading space. A multi-byte character split across tokens shows
    as U+FFFD, as in vLLM; the answer's text is decoded as a whole elsewhere."""

    def decode(ids: Sequence[int]) -> str:
        return decode_ids(ids, False)

    before = decode(context)
    texts = {}
    for token_id in candidates:
        full = decode([*context, token_id])
        texts[token_id] = full[len(before) :] if full.startswith(before) else decode([token_id])
    return texts


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas (the vLLM / TGI prefix/read-offset scheme).

    `tokens[prefix_offset:read_offset]` is already-emitted context; each step decodes it with and
    without the new tokens and emits the difference. The context makes leading-space handling
    match a full decode; holding back text ending in U+FFFD waits out multi-byte characters that
    byte-level BPE splits across tokens (emoji, CJK).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decoder = decoder(tokenizer)
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = prompt_context(self._decoder, prompt_token_ids, skip_special_tokens)
        self._num_context = len(self._tokens)
        self.prefix_offset = 0
        self.read_offset = len(self._tokens)
        self._text: list[str] = []

    @property
    def output_ids(self) -> list[int]:
        return self._tokens[self._num_context :]

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it makes decodable (possibly "")."""
        self._tokens.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        """At end of generation, release text held back for an unfinished character.

        A sequence that really ends in invalid UTF-8 (or in a literal U+FFFD) decodes to U+FFFD
        in a full decode too, so emitting it keeps the deltas equal to `tokenizer.decode`.
        """
        return self._step(final=True) if self.read_offset < len(self._tokens) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self._skip_special)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self._tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._tokens[self.prefix_offset :])
        # Not longer: the new ids decoded to nothing yet (a skipped special token, or bytes
        # that merge into a character); keep the window so they are decoded in context later.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._tokens)
        self._text.append(delta)
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text without ever leaking part of one.

    The longest suffix of the pending text that could still begin a stop string is held back.
    Generation stops at the first character where any stop string is complete (ties: the
    longest, i.e. earliest-starting, one), so the result does not depend on how the text was
    split into deltas; for non-overlapping stops this is simply the earliest occurrence.
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_stop_str_in_output
        # Text ending in a proper prefix of a stop string is held back: one regex over the text's tail finds
        # the longest such suffix (the earliest start), in C.
        prefixes = sorted({s[:k] for s in self._stops for k in range(1, len(s))}, key=len, reverse=True)
        self._longest_prefix = len(prefixes[0]) if prefixes else 0
        self._partial = re.compile("(?:" + "|".join(map(re.escape, prefixes)) + r")\Z") if prefixes else None
        self._any_stop = re.compile("|".join(map(re.escape, self._stops))) if self._stops else None
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, stopped). After a stop, nothing more is emitted."""
        if self.stopped:
            return "", True
        if self._any_stop is None or not delta:
            return delta, False
        text = self._held + delta
        if self._any_stop.search(text) is not None:  # a stop completed: which one ends first
            best: tuple[int, int, str] | None = None  # (end, -len, stop)
            for stop in self._stops:
                i = text.find(stop)
                if i >= 0 and (best is None or (i + len(stop), -len(stop)) < best[:2]):
                    best = (i + len(stop), -len(stop), stop)
            assert best is not None
            end, neg_len, stop = best
            self.stopped, self.matched, self._held = True, stop, ""
            return text[: end if self._include else end + neg_len], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Generation ended for another reason (EOS, max_tokens): the held text was no stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix_len(self, text: str) -> int:
        # No complete stop is in `text` here, so only proper prefixes can match.
        if self._partial is None:
            return 0
        match = self._partial.search(text, max(0, len(text) - self._longest_prefix))
        return 0 if match is None else len(text) - match.start()


class DetokenizedStream:
    """Per-request text stream: ids in, stop-checked text deltas out. One `add` per token. `detokenizer`:
    the request's (runtime/engine/fast_detokenizer.py's Detokenizers make it)."""

    def __init__(self, detokenizer: Any, stops: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(stops, include_stop_str_in_output)
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted to the client so far."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed one generated id; return (text to emit, stop string hit)."""
        if self.matcher.stopped:
            return "", True
        out, stopped = self.matcher.feed(self.detokenizer.add(token_id))
        if out:
            self._emitted.append(out)
        return out, stopped

    def finish(self) -> str:
        """Generation ended without a stop string: emit what was held back.

        The detokenizer's leftover is fed through the matcher first, so a stop completed by it
        still truncates (check `stopped` afterwards).
        """
        if self.matcher.stopped:
            return ""
        out, stopped = self.matcher.feed(self.detokenizer.flush())
        if not stopped:
            out += self.matcher.flush()
        self._emitted.append(out)
        return out

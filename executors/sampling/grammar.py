"""A request's grammar while it generates: the matcher that has read its output so far, the bitmask of the
tokens allowed next, and the masking both samplers apply (structured output; engine_format/grammars.py says
what a grammar can be, runtime/engine/grammar_cache.py compiles it).

The mask is part of the distribution: a disallowed token's logit is -inf before penalties, temperature and
the filters, so greedy, seeded and speculative sampling all choose among allowed tokens only, and logprobs
are those of the distribution actually sampled from. Numpy and torch apply the same bitmask (bit t of word
t // 32 of a row allows token t), filled on the host by llguidance. Rows without a grammar are not touched:
a batch without one costs a scan of its states for `grammar`, nothing else.

The matcher advances only on tokens the engine keeps (SamplingState.append), so a recomputed (preempted)
request's matcher is already where its output is; speculative verification fills the masks after each draft
and rolls the matcher back (`draft_masks`), and the kept tokens advance it like any others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)


class Matcher(Protocol):
    """The part of llguidance's LLMatcher used here (tests stand in for it)."""

    def unsafe_compute_mask_ptr(self, trg_pointer: int, trg_byte_size: int) -> None: ...
    def consume_token(self, sampled_token: int) -> bool: ...
    def rollback(self, num_tokens: int) -> bool: ...
    def validate_tokens(self, tokens: list[int]) -> int: ...
    def deep_copy(self) -> Matcher: ...
    def is_error(self) -> bool: ...
    def get_error(self) -> str: ...


@dataclass
class GrammarCounters:
    """Shared by every request one engine constrains (read by its stats)."""

    masked_steps: int = 0  # rows sampled (or verified) under a grammar's mask
    violations: int = 0  # kept tokens the grammar refused (never, unless a sampler missed a mask)


def words(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


class GrammarState:
    """One request's matcher over its output tokens."""

    def __init__(self, matcher: Matcher, vocab_size: int, eos_token_ids: Sequence[int],
                 counters: GrammarCounters | None = None) -> None:  # fmt: skip
        """`matcher`: fresh, for this request alone; `eos_token_ids`: what ends the request (allowed alone once
        the matcher is in error, so a request whose grammar broke ends rather than runs free)."""
        self.matcher, self.vocab_size = matcher, vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.counters = counters or GrammarCounters()
        self.num_accepted = 0

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's bitmask into `row` (int32 [words(vocab)], C-contiguous)."""
        self.counters.masked_steps += 1
        if self.matcher.is_error():
            row[:] = 0
            for token in self.eos_token_ids:
                row.view(np.uint32)[token >> 5] |= np.uint32(1 << (token & 31))
            return
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def mask(self) -> np.ndarray:
        """The next token's bitmask row."""
        row = np.zeros(words(self.vocab_size), np.int32)
        self.fill(row)
        return row

    def accept(self, token: int) -> None:
        """Advance past a kept token. A refused one (a sampler that skipped the mask) is logged and counted; the
        matcher then allows only the end of the sequence."""
        if self.matcher.consume_token(token):
            self.num_accepted += 1
            return
        self.counters.violations += 1
        log.error("token %d is not allowed by the request's grammar: %s", token, self.matcher.get_error())

    def draft_masks(self, drafts: Sequence[int]) -> np.ndarray:
        """[len(drafts) + 1, words] bitmasks: row j for the token after drafts[:j]. The matcher reads the drafts
        it allows, up to the first it refuses (rows past that one allow everything: verification never reaches
        them, as the refused draft cannot be drawn from the row before it), then is rolled back. A draft is fed to
        the matcher only once its mask allows it: a refused token would leave the matcher in error for good."""
        out = np.full((len(drafts) + 1, words(self.vocab_size)), -1, np.int32)
        consumed = 0
        for j in range(len(drafts) + 1):
            self.fill(out[j])
            if j == len(drafts) or not _allows(out[j], drafts[j]) or not self.matcher.consume_token(drafts[j]):
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return out

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading `drafts` the grammar allows (the rest could never be accepted)."""
        return 0 if self.matcher.is_error() else self.matcher.validate_tokens(list(drafts))


def _allows(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def allowed(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [R, vocab_size] from int32 bitmask rows [R, words]."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def grammar_rows(states: Sequence[Any]) -> list[int]:
    """Indices of the states (SamplingState) whose request has a grammar."""
    return [i for i, s in enumerate(states) if s.grammar is not None]


def mask_logits(logits: np.ndarray, states: Sequence[Any]) -> np.ndarray:
    """`logits` with -inf at each grammar row's disallowed tokens: a float32 copy when any row has a grammar,
    else `logits` itself (never written)."""
    rows = grammar_rows(states)
    if not rows:
        return logits
    bitmask = np.stack([states[i].grammar.mask() for i in rows])
    return apply_bitmask(logits, rows, bitmask)


def apply_bitmask(logits: np.ndarray, rows: Sequence[int], bitmask: np.ndarray) -> np.ndarray:
    """A float32 copy of `logits` with -inf where rows[i]'s bitmask[i] disallows a token."""
    out = np.array(logits, dtype=np.float32)
    out[list(rows)] = np.where(allowed(bitmask, out.shape[1]), out[list(rows)], -np.inf)
    return out

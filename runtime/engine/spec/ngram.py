"""Prompt-lookup (n-gram) proposer: no model, just the sequence's own tokens.

The context's last n tokens (n from `max_n` down to `min_n`: the longest suffix that occurs
earlier wins) are searched for in the rest of the context; the tokens that followed the most
recent earlier occurrence are proposed. Copy-heavy answers (edits of a given passage, code that
repeats identifiers, quoted text) make such matches common.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    caught_up = 0  # stateless: nothing to catch up on

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        request_ids: Sequence[str] = (),
        remaining: Sequence[int] = (),
    ) -> list[list[int]]:
        return [self.propose_one(c, k) for c, k in zip(contexts, max_tokens, strict=True)]

    def release(self, request_id: str) -> None:
        pass  # stateless

    def propose_one(self, context: Sequence[int], k: int) -> list[int]:
        tokens = np.asarray(context, np.int64)
        if k < 1:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that start before the suffix itself: an occurrence ending at the last token is no guess.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match: its continuation is the freshest
                return tokens[start : start + k].tolist()
        return []

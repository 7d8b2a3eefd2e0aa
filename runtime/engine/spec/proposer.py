"""The proposer interface: draft tokens for a batch of running sequences."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    # Context tokens the last propose() computed to bring a request's state up to date (the most for one
    # request; 0 for stateless proposers). Beyond a steady step's (the accepted drafts and the target's
    # token) it is a one-off: a new prompt, or tokens decoded without drafts.
    caught_up: int

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        request_ids: Sequence[str] = (),
        remaining: Sequence[int] = (),
    ) -> list[list[int]]:
        """Draft tokens to follow each context (prompt + output so far), at most max_tokens[i]
        for context i (fewer, or none, when the proposer has no guess). request_ids name the
        requests, for proposers that keep per-request state (a draft engine's KV); remaining: the
        tokens each request may still generate, for proposers whose state costs work to bring up to date."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished: drop whatever the proposer keeps for it."""
        ...

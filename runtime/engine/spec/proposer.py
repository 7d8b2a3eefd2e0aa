"""The proposer interface: draft tokens for a batch of running sequences."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine_format import EngineConfig
from runtime.engine.engine_args import EngineArgs

SPECULATIVE_METHODS = ("ngram", "draft")


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


def create_proposer(args: EngineArgs, target: EngineConfig) -> Proposer | None:
    """The proposer EngineArgs.speculative names (None: speculation off)."""
    if args.speculative is None:
        return None
    if args.speculative == "ngram":
        from runtime.engine.spec.ngram import NgramProposer

        return NgramProposer(args.ngram_prompt_lookup_min, args.ngram_prompt_lookup_max)
    if args.speculative == "draft" and args.draft_engine is not None:
        from runtime.engine.spec.draft import DraftEngineProposer

        # The draft holds K/V for the same tokens as the target: the same pool size in blocks.
        draft = DraftEngineProposer.load(args.draft_engine, target, args.threads, args.draft_backend,
                                         args.num_kv_blocks, args.draft_min_confidence)  # fmt: skip
        if not args.draft_prompt_lookup_min:
            return draft
        from runtime.engine.spec.lookup_first import LookupFirstProposer
        from runtime.engine.spec.ngram import NgramProposer

        shortest = args.draft_prompt_lookup_min
        return LookupFirstProposer(NgramProposer(shortest, max(shortest, args.ngram_prompt_lookup_max)), draft)
    raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} (got {args.speculative!r})")

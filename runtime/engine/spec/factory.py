"""The proposer EngineArgs.speculative names (each proposer's module loads only when chosen)."""

from __future__ import annotations

from engine_format import EngineConfig
from runtime.engine.engine_args import SPECULATIVE_METHODS, EngineArgs
from runtime.engine.spec.proposer import Proposer


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

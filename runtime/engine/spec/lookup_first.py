"""Prompt lookup first, the draft model where lookup has nothing: the `draft` method's proposer.

A request whose text ends in at least `min_n` tokens that occurred earlier in it takes the prompt-lookup
guess (ngram.py: the tokens that followed that occurrence), which costs nothing; only the other requests
run the draft model, whose every guess costs a draft forward pass (an INT4 step of SmolLM2 is ~0.4 of a
target step on the 2-core Xeon). A match of 3 or more tokens is mostly right: answers quote their
prompt, lists and code repeat themselves. A request that took lookup guesses is caught up on the tokens
accepted meanwhile the next time the draft model runs for it (draft.py).

Measured with SmolLM2-135M (fp32 target, its INT4-AWQ draft with an INT4 head, k = 3, single stream),
decode tok/s against no speculation: through tritonserver (benchmarks/results/spec_decode_lookup_first.md)
chat 1.28x -> 1.38x, copy-heavy 1.59x -> 2.31x; in process, a minimum match of 2 or of 4 gave chat
~0.1x less than 3 (short matches guess worse; long ones are rarer).
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.engine.spec.ngram import NgramProposer
from runtime.engine.spec.proposer import Proposer


class LookupFirstProposer:
    def __init__(self, lookup: NgramProposer, draft: Proposer) -> None:
        self.lookup, self.draft = lookup, draft
        self.caught_up = 0
        self.lookup_proposals = self.draft_proposals = 0  # requests proposed for, by source (since start)

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        request_ids: Sequence[str] = (),
        remaining: Sequence[int] = (),
    ) -> list[list[int]]:
        out = [self.lookup.propose_one(c, k) for c, k in zip(contexts, max_tokens, strict=True)]
        rest = [i for i, tokens in enumerate(out) if not tokens]
        self.lookup_proposals += len(out) - len(rest)
        self.draft_proposals += len(rest)
        self.caught_up = 0
        if rest:
            drafted = self.draft.propose(
                [contexts[i] for i in rest], [max_tokens[i] for i in rest], [request_ids[i] for i in rest],
                [remaining[i] for i in rest] if remaining else (),
            )  # fmt: skip
            self.caught_up = self.draft.caught_up
            for i, tokens in zip(rest, drafted, strict=True):
                out[i] = tokens
        return out

    def release(self, request_id: str) -> None:
        self.draft.release(request_id)  # the lookup keeps nothing

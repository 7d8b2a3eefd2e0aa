"""Draft-engine proposer: a second (smaller or quantized) engine of the same tokenizer greedily
decodes k tokens per request, in the same process, over its own KV pool and block tables.

Per request it keeps what its pool holds: the tokens it computed and their blocks, as one sequence of
executors/greedy_runner.py's GreedyRunner (the mechanism greedy_generate is written on). Each call first
catches up: the target's context is compared with what the draft computed (its own rejected drafts
diverge), the common prefix is kept, and the rest (the accepted tokens and the target's new one)
runs as one chunk whose last logits give draft 1; drafts 2..k take one batched single-token step
each. Drafts are the draft model's argmax, so q is one-hot at them: the rejection sampler's n-gram
rule applies and sampled requests keep exactly the target's distribution (sampling drafts from the
draft's own filtered distribution would raise acceptance for them: later work).
A request whose draft state cannot grow (pool full, past the draft's max_seq_len) proposes nothing.

Catch-up limit: a request is caught up over at most CATCH_UP_PER_TOKEN context tokens per token it may
still generate. A new request's prompt passes (paid once, over its whole answer); a request that decoded
undrafted while the batch was too large to speculate does not, near its end: its catch-up would be a
forward pass over its whole context for a handful of tokens (INT4 draft at concurrency 16, copy-heavy:
0.82x of no speculation before the limit, 0.91x with it; benchmarks/results/spec_decode_c16_catchup.md).

Confidence stop: a request stops drafting at the first draft whose probability under the draft model
is below `min_confidence` (that draft is dropped). Each draft step costs a draft forward pass for the
whole batch; a guess the draft itself doubts is mostly rejected, so its step is cost without tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine_format import EngineConfig, EngineLoadError
from executors import create_backend
from executors.base import EngineBackend
from executors.greedy_runner import GreedyRunner


def top_probability(logits: np.ndarray) -> np.ndarray:
    """Softmax probability of each row's argmax [rows] (float64 sums: exact enough for a threshold)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return 1.0 / np.exp(shifted, dtype=np.float64).sum(axis=-1)


CATCH_UP_PER_TOKEN = 4  # context tokens caught up per token the request may still generate (at most)


class DraftEngineProposer:
    """Greedy drafts from a draft engine, over executors/greedy_runner.py's GreedyRunner: one persistent
    sequence per request (keyed by request id), the same mechanism greedy_generate decodes with."""

    def __init__(self, backend: EngineBackend, min_confidence: float = 0.0) -> None:
        self.backend, self.config = backend, backend.config
        self.min_confidence = min_confidence
        self.runner = GreedyRunner(backend)
        self.caught_up = 0

    @classmethod
    def load(cls, draft_dir: str | Path, target: EngineConfig, threads: int | None = None,
             backend: str | None = None, num_blocks: int | None = None,
             min_confidence: float = 0.0) -> DraftEngineProposer:  # fmt: skip
        """The draft engine at `draft_dir`; refuses one whose vocabulary differs from the target's."""
        draft = create_backend(check_draft_vocabulary(draft_dir, target), num_blocks, threads, backend)
        return cls(draft, min_confidence)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        request_ids: Sequence[str] = (),
        remaining: Sequence[int] = (),
    ) -> list[list[int]]:
        """`remaining` (default: unbounded): the tokens each request may still generate, which bound its catch-up."""
        if len(request_ids) != len(contexts):
            raise ValueError("the draft engine keeps KV per request: pass one request id per context")
        out: list[list[int]] = [[] for _ in contexts]
        fits = [i for i, k in enumerate(max_tokens) if k > 0 and len(contexts[i]) + k <= self.config.max_seq_len]
        ends = {}  # request index -> the end of its next chunk
        for i in fits:
            limit = CATCH_UP_PER_TOKEN * remaining[i] if remaining else None
            if (end := self._catch_up(request_ids[i], list(contexts[i]), limit)) is not None:
                ends[i] = end
        sequences = self.runner.sequences
        self.caught_up = max((end - sequences[request_ids[i]].computed for i, end in ends.items()), default=0)
        while ends:  # one batched draft step per token: the catch-up chunks first, then single tokens
            result = self.runner.step([(request_ids[i], end) for i, end in ends.items()])
            # The softmax costs a pass over the vocabulary per row: only when a bar is set.
            logits = result.logits
            sure = top_probability(logits) >= self.min_confidence if self.min_confidence > 0 else [True] * len(logits)
            going = []
            for i, token, confident in zip(ends, result.tokens, sure, strict=True):
                if confident:  # a doubted draft is dropped: the next catch-up rewinds past it
                    assert token is not None  # every chunk runs to its sequence's end
                    out[i].append(token)
                    going += [i] if len(out[i]) < max_tokens[i] else []
            # The next step feeds the draft just made, so its K/V is computed too.
            ends = {i: end for i in going if (end := self._next(request_ids[i])) is not None}
        return out

    def _catch_up(self, request_id: str, context: list[int], limit: int | None = None) -> int | None:
        """Bring the request's draft sequence up to `context`: what the draft computed beyond their
        common prefix (rejected drafts, a draft it doubted) is dropped, at least the last token is
        recomputed. Returns the end of the chunk to run; None when more than `limit` tokens would run
        (the sequence is left as it is) or when the pool cannot hold it (the sequence is released)."""
        seq = self.runner.extend(request_id, [])
        keep = 0
        common = min(seq.computed, len(context) - 1)
        while keep < common and seq.tokens[keep] == context[keep]:
            keep += 1
        if limit is not None and len(context) - keep > limit:
            return None
        self.runner.rewind(request_id, keep)
        self.runner.extend(request_id, context[keep:])
        return self._reserved(request_id, len(context))

    def _next(self, request_id: str) -> int | None:
        """The end of the chunk feeding the request's newest draft (None: released, the pool is full)."""
        return self._reserved(request_id, self.runner.sequences[request_id].computed + 1)

    def _reserved(self, request_id: str, end: int) -> int | None:
        if self.runner.reserve(request_id, end):
            return end
        self.runner.release(request_id)
        return None


def check_draft_vocabulary(draft_dir: str | Path, target: EngineConfig) -> EngineConfig:
    """The draft engine's config; EngineLoadError when its vocabulary (size or tokenizer entries) differs
    from the target's: its drafts would be other tokens. `trtserve serve` checks before starting Triton."""
    from runtime.engine.tokenizer import load_tokenizer

    draft = EngineConfig.load(draft_dir, verify=True)  # served: its files against its manifest
    ours, theirs = load_tokenizer(draft_dir).get_vocab(), load_tokenizer(target.engine_dir).get_vocab()
    if draft.model.vocab_size != target.model.vocab_size or ours != theirs:
        raise EngineLoadError(
            f"draft engine {draft_dir} has another vocabulary than the target (vocab_size "
            f"{draft.model.vocab_size} vs {target.model.vocab_size}, {len(ours)} vs {len(theirs)} tokenizer "
            "entries): speculative drafts need the same tokenizer"
        )
    return draft

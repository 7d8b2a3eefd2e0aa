"""Draft-engine proposer: a second (smaller or quantized) engine of the same tokenizer greedily
decodes k tokens per request, in the same process, over its own KV pool and block tables.

Per request it keeps what its pool holds: the tokens it computed and their blocks. Each call first
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_format import EngineConfig, EngineLoadError
from executors import create_backend
from executors.base import EngineBackend, SequenceChunk


@dataclass
class _DraftState:
    tokens: list[int] = field(default_factory=list)  # token ids whose K/V the draft pool holds, in order
    blocks: list[int] = field(default_factory=list)


def top_probability(logits: np.ndarray) -> np.ndarray:
    """Softmax probability of each row's argmax [rows] (float64 sums: exact enough for a threshold)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return 1.0 / np.exp(shifted, dtype=np.float64).sum(axis=-1)


CATCH_UP_PER_TOKEN = 4  # context tokens caught up per token the request may still generate (at most)


class DraftEngineProposer:
    def __init__(self, backend: EngineBackend, min_confidence: float = 0.0) -> None:
        self.backend, self.config = backend, backend.config
        self.min_confidence = min_confidence
        self.free_blocks = list(range(backend.num_blocks - 1, -1, -1))  # pop() hands out the lowest id
        self.states: dict[str, _DraftState] = {}
        self.caught_up = 0

    @classmethod
    def load(cls, draft_dir: str | Path, target: EngineConfig, threads: int | None = None,
             backend: str | None = None, num_blocks: int | None = None,
             min_confidence: float = 0.0) -> DraftEngineProposer:  # fmt: skip
        """The draft engine at `draft_dir`; refuses one whose vocabulary differs from the target's."""
        draft = create_backend(check_draft_vocabulary(draft_dir, target), num_blocks, threads, backend)
        return cls(draft, min_confidence)

    def release(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free_blocks.extend(reversed(state.blocks))

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
        chunks = {}
        for i in fits:
            limit = CATCH_UP_PER_TOKEN * remaining[i] if remaining else None
            if (chunk := self._catch_up(request_ids[i], list(contexts[i]), limit)) is not None:
                chunks[i] = chunk
        self.caught_up = max((len(c.token_ids) for c in chunks.values()), default=0)
        while chunks:  # one batched draft step per token: the catch-up chunks first, then single tokens
            logits = self.backend.step(list(chunks.values()))
            # The softmax costs a pass over the vocabulary per row: only when a bar is set.
            sure = top_probability(logits) >= self.min_confidence if self.min_confidence > 0 else [True] * len(logits)
            going = []
            for i, row, confident in zip(chunks, logits, sure, strict=True):
                if confident:
                    out[i].append(int(np.argmax(row)))
                    going += [i] if len(out[i]) < max_tokens[i] else []
            # The next step feeds the draft just made, so its K/V is computed too.
            chunks = {i: c for i in going if (c := self._extend(request_ids[i], [out[i][-1]])) is not None}
        return out

    def _catch_up(self, request_id: str, context: list[int], limit: int | None = None) -> SequenceChunk | None:
        """The chunk that brings the draft's pool up to `context`: what it computed beyond their
        common prefix (rejected drafts) is dropped, at least the last token is recomputed. None when
        more than `limit` tokens would run (the state is left as it is)."""
        state = self.states.setdefault(request_id, _DraftState())
        keep = 0
        common = min(len(state.tokens), len(context) - 1)
        while keep < common and state.tokens[keep] == context[keep]:
            keep += 1
        if limit is not None and len(context) - keep > limit:
            return None
        del state.tokens[keep:]
        return self._extend(request_id, context[keep:])

    def _extend(self, request_id: str, tokens: list[int]) -> SequenceChunk | None:
        """A chunk of `tokens` after the request's computed ones, with blocks for them (None, the
        request's state released, when the pool has none left)."""
        state = self.states[request_id]
        past, bs = len(state.tokens), self.config.block_size
        need = -(-(past + len(tokens)) // bs) - len(state.blocks)
        if need > len(self.free_blocks):
            self.release(request_id)
            return None
        state.blocks += [self.free_blocks.pop() for _ in range(max(need, 0))]
        state.tokens += tokens
        return SequenceChunk(tokens, past, list(state.blocks))


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

"""Greedy decoding over an engine backend, one persistent sequence per key: no scheduler, no engine.

The mechanism under both greedy loops that run a backend without the engine: `greedy_generate`
(executors/greedy.py: the reference the engine is tested against, the quality gate, the benchmarks)
and the draft-engine proposer (runtime/engine/spec/draft.py, whose sequences outlive a call: one per
request, caught up with the target's tokens each time it drafts). What they share is here:

- a sequence's known tokens, how many of them a step has computed (their K/V are in the pool), and the
  KV blocks holding them, from one FreeBlockQueue over the backend's pool (lowest ids first; a released
  sequence's blocks are reused first, in order);
- `step`: one backend call running each named sequence's tokens computed..end, after which a sequence
  whose every known token is computed gets its next token, the argmax of its last logits row.

The callers keep the policy: which sequences run together and how far (greedy_generate's documented
call split; the proposer's catch-up chunk, then one token per call), when to stop, and `rewind` (the
proposer drops drafts the target rejected: the recomputed positions overwrite their K/V).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from engine_format import ceil_div
from executors.base import EngineBackend, SequenceChunk
from executors.free_blocks import FreeBlockQueue, NoFreeBlocks


class OutOfBlocks(NoFreeBlocks):
    """The backend's KV pool cannot hold the sequences running together."""


@dataclass
class PooledSequence:
    tokens: list[int] = field(default_factory=list)  # known token ids, in order
    computed: int = 0  # leading tokens a step has run: their K/V are in the pool
    blocks: list[int] = field(default_factory=list)  # the pool blocks of positions 0, block_size, ...


class GreedyStepResult(NamedTuple):
    chunks: list[SequenceChunk]  # what the backend ran, one chunk per work item
    logits: np.ndarray  # [items, vocab] float32: each chunk's last row
    tokens: list[int | None]  # each item's next token, None where known tokens were left uncomputed


class GreedyRunner:
    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend
        self.block_size = backend.config.block_size
        self.free = FreeBlockQueue(range(backend.num_blocks))
        self.sequences: dict[Hashable, PooledSequence] = {}

    def extend(self, key: Hashable, tokens: Sequence[int]) -> PooledSequence:
        """Append known tokens to `key`'s sequence (a new, empty one for a new key); none is computed."""
        seq = self.sequences.setdefault(key, PooledSequence())
        seq.tokens += tokens
        return seq

    def rewind(self, key: Hashable, length: int) -> None:
        """Forget `key`'s tokens past `length`; its blocks stay reserved (the positions are recomputed)."""
        seq = self.sequences[key]
        del seq.tokens[length:]
        seq.computed = min(seq.computed, length)

    def reserve(self, key: Hashable, end: int) -> bool:
        """Blocks for `key`'s positions < end; False, nothing reserved, when the pool has too few free."""
        seq = self.sequences[key]
        need = ceil_div(end, self.block_size) - len(seq.blocks)
        if need > len(self.free):
            return False
        seq.blocks += self.free.take(max(need, 0))
        return True

    def step(self, work: Sequence[tuple[Hashable, int]]) -> GreedyStepResult:
        """One backend call running each (key, end)'s tokens computed..end (blocks reserved first:
        OutOfBlocks when the pool cannot hold them). Each sequence whose every known token is then
        computed gets its next token: its logits row's argmax, appended to its tokens."""
        chunks = []
        for key, end in work:
            seq = self.sequences[key]
            if not self.reserve(key, end):
                raise OutOfBlocks(f"KV pool of {self.backend.num_blocks} blocks is full")
            chunks.append(SequenceChunk(seq.tokens[seq.computed : end], seq.computed, list(seq.blocks)))
        logits = self.backend.step(chunks)
        tokens: list[int | None] = []
        for (key, end), row in zip(work, logits, strict=True):
            seq = self.sequences[key]
            seq.computed = end
            if end < len(seq.tokens):
                tokens.append(None)  # a prompt chunk short of the prompt's end: its logits are not needed
                continue
            token = int(np.argmax(row))
            seq.tokens.append(token)
            tokens.append(token)
        return GreedyStepResult(chunks, logits, tokens)

    def release(self, key: Hashable) -> PooledSequence | None:
        """Drop `key`'s sequence (returned; None when unknown); its blocks go back to be reused first."""
        seq = self.sequences.pop(key, None)
        if seq is not None:
            self.free.prepend(seq.blocks)
        return seq

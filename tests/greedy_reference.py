"""A minimal greedy generate loop straight over an engine backend: the independent
reference the scheduler-driven engine is compared with (itself checked against HF eager
in test_engine_parity).

Each step makes at most two backend calls: one for every decoding sequence (one token each)
and one for the next prefill chunk of every sequence still prefilling. Two calls rather than
one because the graph takes a padded [batch, step] layout: padding decodes to a prefill
chunk's length would multiply their cost by the chunk length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.backends.base import EngineBackend, SequenceChunk


class OutOfBlocks(RuntimeError):
    pass


@dataclass
class _Sequence:
    token_ids: list[int]
    prompt_len: int
    max_new_tokens: int
    computed: int = 0  # tokens whose K/V are in the pool
    blocks: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


def greedy_generate(
    backend: EngineBackend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    prefill_chunk: int = 512,
) -> list[list[int]]:
    """Greedy-decode every prompt; returns the generated token ids (stop token included)."""
    config = backend.config
    free_blocks = list(range(backend.num_blocks - 1, -1, -1))
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    seqs = [_Sequence(list(p), len(p), max_new_tokens) for p in prompts]
    for seq in seqs:
        if not seq.token_ids or seq.prompt_len + max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"prompt of {seq.prompt_len} tokens + max_new_tokens {max_new_tokens} must be "
                f"1..{config.max_seq_len} tokens (the engine's max_seq_len)"
            )

    def reserve(seq: _Sequence, upto: int) -> None:
        while len(seq.blocks) * config.block_size < upto:
            if not free_blocks:
                raise OutOfBlocks(f"KV pool of {backend.num_blocks} blocks is full")
            seq.blocks.append(free_blocks.pop())

    def finish_token(seq: _Sequence, logits: np.ndarray) -> None:
        token = int(np.argmax(logits))
        seq.token_ids.append(token)
        if token in stop_token_ids or len(seq.generated) >= seq.max_new_tokens:
            seq.done = True
            free_blocks.extend(reversed(seq.blocks))
            seq.blocks.clear()

    while any(not s.done for s in seqs):
        active = [s for s in seqs if not s.done][: config.max_batch_size]
        decoding = [s for s in active if s.computed == len(s.token_ids) - 1 and s.computed >= s.prompt_len]
        prefilling = [s for s in active if s not in decoding]
        if decoding:
            for seq in decoding:
                reserve(seq, seq.computed + 1)
            chunks = [SequenceChunk(s.token_ids[-1:], s.computed, s.blocks) for s in decoding]
            for seq, logits in zip(decoding, backend.step(chunks), strict=True):
                seq.computed += 1
                finish_token(seq, logits)
        if prefilling:
            chunks = []
            for seq in prefilling:
                end = min(seq.prompt_len, seq.computed + prefill_chunk)
                reserve(seq, end)
                chunks.append(SequenceChunk(seq.token_ids[seq.computed : end], seq.computed, seq.blocks))
            for seq, chunk, logits in zip(prefilling, chunks, backend.step(chunks), strict=True):
                seq.computed += len(chunk.token_ids)
                if seq.computed == seq.prompt_len:
                    finish_token(seq, logits)
    return [s.generated for s in seqs]

"""Sampling on the device: a backend that samples (`DeviceSampling`) returns token ids instead of [batch,
vocab] logits, sampled with the engine's own SamplingState (executors/sampling/). Also the check of a
step's chunks that the GPU backends run before indexing their pools unchecked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from engine_format import EngineConfig
from executors.base import SequenceChunk
from executors.sampling.state import DeviceSample, SamplingState


@runtime_checkable
class DeviceSampling(Protocol):
    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None]) -> DeviceSample:
        """`step(chunks)`, then sample row i from its last token's logits with rows[i] (None: not
        sampled, a prompt chunk short of its prompt's end), on the device."""
        ...


def check_chunks(chunks: Sequence[SequenceChunk], config: EngineConfig, num_blocks: int) -> None:
    """Refuse a step the GPU kernels would index the pool with unchecked: a block table short of
    the chunk's positions or naming a block outside the pool, positions past max_seq_len, token
    ids outside the vocabulary, logit rows outside the chunk. ValueError names the chunk."""
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    bs, vocab = config.block_size, config.model.vocab_size
    for i, c in enumerate(chunks):
        n, end = len(c.token_ids), c.past_len + len(c.token_ids)
        if n < 1 or c.past_len < 0 or end > config.max_seq_len:
            raise ValueError(
                f"chunk {i}: {n} tokens after past_len {c.past_len} must fit in 1..{config.max_seq_len} positions"
            )
        if not 1 <= c.num_logits <= n:
            raise ValueError(f"chunk {i}: num_logits {c.num_logits} must be in 1..{n} (its tokens)")
        need = -(-end // bs)
        if len(c.block_table) < need:
            raise ValueError(
                f"chunk {i}: block table of {len(c.block_table)} blocks covers {len(c.block_table) * bs} "
                f"positions, {end} needed"
            )
        table = np.asarray(c.block_table[:need], np.int64)
        outside = table[(table < 0) | (table >= num_blocks)]
        if outside.size:
            raise ValueError(f"chunk {i}: block table names block {outside[0]}, outside the pool (0..{num_blocks - 1})")
        ids = np.asarray(c.token_ids, np.int64)
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"chunk {i}: token ids must be in [0, {vocab}) (got {ids.min()}..{ids.max()})")

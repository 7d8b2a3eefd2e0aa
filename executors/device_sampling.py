"""Sampling on the device: a backend that samples (`DeviceSampling`) returns token ids instead of [batch,
vocab] logits, sampled with the engine's own SamplingState (executors/sampling/). Also the check of a
step's chunks that the GPU backends run before indexing their pools unchecked.

Overlapped steps (`OverlappedSampling`): `launch` queues a step on the device and returns at once, so the
host schedules and packs the next step while the device computes this one (vLLM's async scheduling,
SGLang's overlap scheduler). The next step's decodes need the tokens this one samples, which the host does
not know yet: their chunks carry PLACEHOLDER, and `sources` names the row of the previous launch whose
sampled token each takes, copied on the device.
"""

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


PLACEHOLDER = -1  # a token the previous launch samples on the device (OverlappedSampling)


class PendingSample(Protocol):
    def result(self) -> DeviceSample:
        """The launched step's sampled tokens on the host (waits for the device)."""
        ...


@runtime_checkable
class OverlappedSampling(Protocol):
    def launch(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None],
               sources: np.ndarray, previous: PendingSample | None) -> PendingSample:  # fmt: skip
        """`step_sample`, queued: returns before the device has finished. Chunk i's first token is
        PLACEHOLDER where sources[i] >= 0: the token `previous` sampled in its row sources[i]. Rows must not
        ask for logprobs or penalties (their host state would lag a token behind); the engine runs such
        steps through `step_sample`."""
        ...


def check_chunks(chunks: Sequence[SequenceChunk], config: EngineConfig, num_blocks: int,
                 placeholders: np.ndarray | None = None) -> None:  # fmt: skip
    """Refuse a step the GPU kernels would index the pool with unchecked: a block table short of
    the chunk's positions or naming a block outside the pool, positions past max_seq_len, token
    ids outside the vocabulary, logit rows outside the chunk. ValueError names the chunk. `placeholders[i]`:
    chunk i's first token is PLACEHOLDER (an overlapped launch's), filled on the device."""
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
        if placeholders is not None and placeholders[i]:
            if ids[0] != PLACEHOLDER:
                raise ValueError(f"chunk {i}: its first token should be the previous launch's (PLACEHOLDER)")
            ids = ids[1:] if n > 1 else np.zeros(1, np.int64)
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"chunk {i}: token ids must be in [0, {vocab}) (got {ids.min()}..{ids.max()})")

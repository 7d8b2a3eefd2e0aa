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

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol, runtime_checkable

import numpy as np

from engine_format import EngineConfig
from executors.base import SequenceChunk
from executors.block_table_rows import BlockTableRows
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
    ChunkArrays.gather(chunks, config.block_size).check(config, num_blocks, placeholders)


def _int64s(values: Iterable[int], count: int) -> np.ndarray:
    """`count` Python ints as a read-only int64 array: struct packs them about twice as fast as np.fromiter."""
    return np.frombuffer(struct.pack(f"{count}q", *values), np.int64)


@dataclass(slots=True)  # not frozen: built every step, and a frozen __init__ costs a setattr per field
class ChunkArrays:
    """A step's chunks gathered into flat arrays by one pass of Python over them; the checks (and
    HostStep.pack's layout) are then numpy calls over the whole batch, not a few per chunk, which
    left a batch-256 GPU decode step waiting on the host."""

    lengths: np.ndarray  # [B] tokens per chunk
    past_lens: np.ndarray  # [B]
    num_logits: np.ndarray  # [B]
    table_lens: np.ndarray  # [B] blocks in each chunk's table
    need: np.ndarray  # [B] blocks that cover each chunk's positions (0 where it has none)
    query_start: np.ndarray  # [B + 1] chunk b's tokens are token_ids[query_start[b] : query_start[b + 1]]
    token_ids: np.ndarray  # [T] every chunk's tokens, chunk after chunk
    tables: np.ndarray  # each chunk's table up to `need` blocks (fewer where it is shorter), chunk after chunk

    @classmethod
    def gather(
        cls, chunks: Sequence[SequenceChunk], block_size: int, rows: BlockTableRows | None = None
    ) -> ChunkArrays:
        """`rows`: the backend's persistent batch, which holds the tables of chunks with a slot (every chunk
        must have one then); else each table is read from its chunk."""
        scalars = [(len(c.token_ids), c.past_len, c.num_logits, len(c.block_table)) for c in chunks]
        lengths, past_lens, num_logits, table_lens = (
            _int64s(chain.from_iterable(scalars), 4 * len(chunks)).reshape(-1, 4).T
        )
        need = np.maximum(past_lens + lengths + (block_size - 1), 0) // block_size  # 0 where there is no position
        if rows is not None:
            width = int(need.max(initial=0))
            kept = np.arange(width) < np.minimum(need, table_lens)[:, None]
            tables = rows.gather(chunks, [c.slot for c in chunks], width)[kept]  # type: ignore[misc]
        else:
            prefixes = [c.block_table[:k] for c, k in zip(chunks, need.tolist(), strict=True)]
            tables = _int64s(chain.from_iterable(prefixes), int(np.minimum(need, table_lens).sum()))
        query_start = np.zeros(len(chunks) + 1, np.int64)
        lengths.cumsum(out=query_start[1:])
        token_ids = _int64s(chain.from_iterable([c.token_ids for c in chunks]), int(query_start[-1]))
        return cls(lengths, past_lens, num_logits, table_lens, need, query_start, token_ids, tables)

    def check(self, config: EngineConfig, num_blocks: int, placeholders: np.ndarray | None = None) -> None:
        """check_chunks on the gathered arrays."""
        if not self.lengths.size:
            raise ValueError("a step needs at least one chunk")
        n, num_logits = self.lengths, self.num_logits
        bad_first = np.zeros(n.size, bool)  # a placeholder chunk whose first token is not PLACEHOLDER
        bad_ids = (self.token_ids < 0) | (self.token_ids >= config.model.vocab_size)
        filled = np.empty(0, np.int64)  # the placeholder chunks with a first token
        if placeholders is not None:
            filled = np.flatnonzero(np.asarray(placeholders, bool) & (n > 0))
            bad_first[filled] = self.token_ids[self.query_start[filled]] != PLACEHOLDER
            bad_ids[self.query_start[filled]] = False  # not a token id yet: filled on the device
        failed = [  # in the order each chunk is checked: per chunk, or per entry of tables and token_ids
            (n < 1) | (self.past_lens < 0) | (self.past_lens + n > config.max_seq_len),
            (num_logits < 1) | (num_logits > n),
            self.table_lens < self.need,
            (self.tables < 0) | (self.tables >= num_blocks),
            bad_first,
            bad_ids,
        ]
        if any(map(np.count_nonzero, failed)):
            self._refuse(failed, config, num_blocks, filled)

    def _refuse(self, failed: list[np.ndarray], config: EngineConfig, num_blocks: int, filled: np.ndarray) -> None:
        """Raise for the first chunk failing a check, with the first check it fails (`failed`: as in check)."""
        bs, vocab, n = config.block_size, config.model.vocab_size, self.lengths
        entry_ends = {3: np.cumsum(np.minimum(self.need, self.table_lens)), 5: self.query_start[1:]}
        firsts = [_first_chunk(bad, entry_ends.get(k)) for k, bad in enumerate(failed)]
        i = min(firsts)
        k, n_i, past, tables = firsts.index(i), int(n[i]), int(self.past_lens[i]), int(self.table_lens[i])
        if k == 0:
            raise ValueError(
                f"chunk {i}: {n_i} tokens after past_len {past} must fit in 1..{config.max_seq_len} positions"
            )
        if k == 1:
            raise ValueError(f"chunk {i}: num_logits {self.num_logits[i]} must be in 1..{n_i} (its tokens)")
        if k == 2:
            raise ValueError(
                f"chunk {i}: block table of {tables} blocks covers {tables * bs} positions, {past + n_i} needed"
            )
        if k == 3:
            block = self.tables[failed[3].nonzero()[0][0]]
            raise ValueError(f"chunk {i}: block table names block {block}, outside the pool (0..{num_blocks - 1})")
        if k == 4:
            raise ValueError(f"chunk {i}: its first token should be the previous launch's (PLACEHOLDER)")
        ids = self.token_ids[self.query_start[i] + int(i in filled) : self.query_start[i + 1]]
        raise ValueError(f"chunk {i}: token ids must be in [0, {vocab}) (got {ids.min()}..{ids.max()})")


def _first_chunk(bad: np.ndarray, chunk_ends: np.ndarray | None) -> int:
    """The first chunk with a bad entry, the number of chunks if none: `bad` per chunk, or (chunk_ends) per
    entry of an array laid out chunk after chunk, chunk b's entries ending before chunk_ends[b]."""
    hits = bad.nonzero()[0]
    if chunk_ends is None:
        return int(hits[0]) if hits.size else bad.size
    return int(np.searchsorted(chunk_ends, hits[0], "right")) if hits.size else chunk_ends.size

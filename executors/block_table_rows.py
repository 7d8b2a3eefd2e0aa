"""The persistent batch's block tables (vLLM's InputBatch block table, SGLang's req_to_token pool): one
preallocated row per slot (SequenceChunk.slot), each holding the block table of the sequence running in
it, kept across steps.

A step's tables are then a numpy gather of its slots' rows, and the per-step Python work is one identity
test per chunk: a sequence's table list is replaced when it changes (a new block every block_size tokens,
a trim of rejected drafts, a new sequence in the slot), never edited in place, so a row is rewritten only
when its chunk brings a new list. Without this, every step converted every entry of every table from
Python ints, O(batch x blocks) (packing a 256 x 2,048-token decode step: 811 against 366 µs through the rows,
benchmarks/pack_rows.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from executors.base import SequenceChunk


class BlockTableRows:
    def __init__(self, num_slots: int, width: int) -> None:
        """`num_slots` rows of `width` blocks (the most a max_seq_len sequence needs)."""
        self.tables = np.zeros((num_slots, width), np.int64)
        self._sources: list[Sequence[int] | None] = [None] * num_slots  # the list each row was copied from
        self.rewrites = 0  # rows copied since start (a test's and a benchmark's view of the O(changes) claim)

    def gather(self, chunks: Sequence[SequenceChunk], slots: list[int], width: int) -> np.ndarray:
        """The chunks' tables [len(chunks), width] (each row's blocks past its table's end are zeros), the rows
        brought up to date first. ValueError for a slot outside the rows or a table wider than a row."""
        num_slots, row_width = self.tables.shape
        sources, tables = self._sources, self.tables
        for i, (chunk, slot) in enumerate(zip(chunks, slots, strict=True)):
            if not 0 <= slot < num_slots:
                raise ValueError(f"chunk {i}: slot {slot} is outside the persistent batch (0..{num_slots - 1})")
            table = chunk.block_table
            if sources[slot] is table:
                continue
            n = len(table)
            if n > row_width:
                raise ValueError(f"chunk {i}: block table of {n} blocks, more than a sequence holds ({row_width})")
            tables[slot, :n] = table
            tables[slot, n:] = 0
            sources[slot] = table
            self.rewrites += 1
        return tables[slots, :width]

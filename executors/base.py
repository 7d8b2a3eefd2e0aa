"""The engine backend interface: one call runs one batch of sequence chunks.

The runtime (scheduler, block manager) decides which tokens run and which KV blocks they
use; a backend only executes. Backends own the KV pool memory and write each step's new
K/V rows into it. The ONNX Runtime backend implements this on CPU; a TensorRT backend
implements the same interface on GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine_format import EngineConfig, ceil_div


@dataclass(slots=True)  # not frozen: one per request per step, and a frozen __init__ costs ~3x (a setattr per field)
class SequenceChunk:
    """One sequence's share of a step: `token_ids` go at positions past_len, past_len+1, ...

    `block_table` must cover every position up to past_len + len(token_ids). The step returns
    logits for the chunk's last `num_logits` tokens: 1 normally (the token that is sampled),
    k + 1 when the chunk ends in k speculative draft tokens that are verified.

    `slot`: the sequence's row in the backend's persistent batch (executors/block_table_rows.py), held by
    one running sequence at a time (0 <= slot < the engine's max_batch_size), or None. A sequence's
    `block_table` is then replaced when it changes, never edited in place, so a backend that keeps each
    slot's table copies a row only when its list is a new one.

    `lora_slot`: the backend's LoRA slot (executors/lora) whose adapter updates this chunk's projections, or
    None for the base model.
    """

    token_ids: Sequence[int]
    past_len: int
    block_table: Sequence[int]
    num_logits: int = 1
    slot: int | None = None
    lora_slot: int | None = None


def logit_rows(lengths: np.ndarray, num_logits: np.ndarray, row_starts: np.ndarray) -> np.ndarray:
    """Flat rows whose logits a step returns (vLLM's logits_indices): chunk b's last num_logits[b]
    tokens, chunk after chunk, where chunk b's tokens start at flat row row_starts[b]."""
    # chunk b's output rows r end at cumsum(num_logits)[b], where its tokens end: r's token is r + the shift.
    shifts = np.repeat(row_starts + lengths - np.cumsum(num_logits), num_logits)
    return shifts + np.arange(shifts.size, dtype=np.int64)


def num_logit_rows(chunks: Sequence[SequenceChunk]) -> int:
    return sum(c.num_logits for c in chunks)


@dataclass(frozen=True)
class StepTensors:
    """A step packed into the graph's padded [batch, step] layout (see engine_format/INTERFACE.md)."""

    input_ids: np.ndarray  # [B, S] int64
    positions: np.ndarray  # [B, S] int64
    seq_lens: np.ndarray  # [B] int64
    past_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, M] int64, M = blocks holding cached rows (>= 1), or all rows (cover_step)
    row_index: np.ndarray  # flat indices into B*S of the real (non-padding) rows
    slots: np.ndarray  # pool slot (block*block_size + offset) of each real row
    logit_rows: np.ndarray  # [rows] int64: flat indices into B*S whose logits are returned

    @classmethod
    def pack(cls, chunks: Sequence[SequenceChunk], block_size: int, cover_step: bool = False) -> StepTensors:
        """cover_step: the tables also cover this step's new positions (the plugin graph reads
        them back from the pool); otherwise only the cached ones (the portable graph)."""
        batch = len(chunks)
        step = max(len(c.token_ids) for c in chunks)
        extra = 1 if cover_step else 0
        table_blocks = max(1, max(ceil_div(c.past_len + extra * len(c.token_ids), block_size) for c in chunks))
        input_ids = np.zeros((batch, step), np.int64)
        positions = np.zeros((batch, step), np.int64)
        block_tables = np.zeros((batch, table_blocks), np.int64)
        rows, slots = [], []
        for b, chunk in enumerate(chunks):
            n, past = len(chunk.token_ids), chunk.past_len
            pos = np.arange(past, past + n)
            table = np.asarray(chunk.block_table, np.int64)
            input_ids[b, :n] = chunk.token_ids
            positions[b, :n] = pos
            positions[b, n:] = pos[-1]  # padding rows repeat the last position (never all-masked)
            cached = min(len(table), table_blocks)
            block_tables[b, :cached] = table[:cached]
            rows.append(b * step + np.arange(n))
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        return cls(
            input_ids=input_ids,
            positions=positions,
            seq_lens=np.array([len(c.token_ids) for c in chunks], np.int64),
            past_lens=np.array([c.past_len for c in chunks], np.int64),
            block_tables=block_tables,
            row_index=np.concatenate(rows),
            slots=np.concatenate(slots),
            logit_rows=logit_rows(
                np.array([len(c.token_ids) for c in chunks]),
                np.array([c.num_logits for c in chunks]),
                np.arange(batch) * step,
            ),
        )


class EngineBackend(Protocol):
    config: EngineConfig
    num_blocks: int

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        """Run the chunks; write their K/V into the pool; return float32 logits [rows, vocab]:
        each chunk's last `num_logits` tokens, chunk after chunk (rows = sum of num_logits)."""
        ...

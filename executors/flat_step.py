"""A step's chunks as one flat ragged token list: the layout of the CPU segments and the kernel
(engine_format/INTERFACE.md, "The CPU segments"), shared by the `cpu`, `cpu-bf16` and `cpu-int8` backends."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine_format import EngineConfig, EngineLoadError
from executors.base import SequenceChunk, logit_rows
from executors.lora import NO_ROWS, LoraRows, LoraSlots


@dataclass(frozen=True)
class FlatStep:
    """A step's chunks as one flat token list."""

    input_ids: np.ndarray  # [T, 1] int64
    positions: np.ndarray  # [T, 1] int64
    seq_of_token: np.ndarray  # [T] int64: index of the token's chunk
    block_tables: np.ndarray  # [B, M] int64
    slots: np.ndarray  # [T] pool slot of each token's K/V
    logit_rows: np.ndarray  # [rows] positions in T of each chunk's last num_logits tokens
    loras: LoraRows = NO_ROWS  # tokens that run under a LoRA adapter, and their slots

    @classmethod
    def pack(cls, chunks: Sequence[SequenceChunk], block_size: int) -> FlatStep:
        lengths = np.array([len(c.token_ids) for c in chunks])
        width = max(len(c.block_table) for c in chunks)
        tables = np.zeros((len(chunks), width), np.int64)
        for b, chunk in enumerate(chunks):
            tables[b, : len(chunk.block_table)] = chunk.block_table
        seq_of_token = np.repeat(np.arange(len(chunks)), lengths)
        starts = np.repeat([c.past_len for c in chunks], lengths)
        positions = starts + np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        return cls(
            input_ids=np.concatenate([np.asarray(c.token_ids, np.int64) for c in chunks])[:, None],
            positions=positions[:, None],
            seq_of_token=seq_of_token,
            block_tables=tables,
            slots=slots,
            logit_rows=logit_rows(lengths, np.array([c.num_logits for c in chunks]), np.cumsum(lengths) - lengths),
            loras=LoraRows.of([c.lora_slot for c in chunks], lengths)
            if any(c.lora_slot is not None for c in chunks)
            else NO_ROWS,
        )


class FlatStepBackend(abc.ABC):
    """The entry points of a backend that runs each step as one flat token list: it implements `_run`."""

    config: EngineConfig
    name: str  # the backend kind (executors/factory.py)
    lora_targets: tuple[str, ...] = ()  # the projections it applies LoRA adapters to (none: no LoRA)
    lora: LoraSlots | None = None
    lora_half: bool = False  # keep adapters as float16 (executors/lora/slots.py): where the tolerance allows it

    def enable_lora(self, num_slots: int, max_rank: int) -> LoraSlots:
        """Serve adapters from now on: `num_slots` of them resident at once (filled by the engine), of ranks up to
        `max_rank` (the engine refuses higher ones; a CPU slot holds an adapter's own matrices, of any rank)."""
        if not self.lora_targets:
            raise EngineLoadError(f"the {self.name} backend does not apply LoRA adapters: use --backend cpu-bf16")
        self.lora = LoraSlots(self.config.model, num_slots, self.name, self.lora_targets, self.lora_half)
        self.lora.threads = getattr(self, "threads", 1)
        return self.lora

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        flat = FlatStep.pack(chunks, self.config.block_size)
        return self._run(flat, flat.logit_rows)

    def prompt_logits(self, chunk: SequenceChunk) -> np.ndarray:
        """The logits of every token of one chunk [len(token_ids), vocab] (teacher-forced scoring: perplexity,
        KL between engines)."""
        flat = FlatStep.pack([chunk], self.config.block_size)
        return self._run(flat, np.arange(len(chunk.token_ids)))

    @abc.abstractmethod
    def _run(self, flat: FlatStep, logit_rows: np.ndarray) -> np.ndarray:
        """Logits [len(logit_rows), vocab] of the flat step's rows `logit_rows`."""

"""Greedy generation straight over an engine backend: no scheduler, no KV-cache manager.

One plain loop for everything that wants a backend's own greedy tokens without the engine
around it: the independent reference the scheduler-driven engine is tested against (itself
checked against HF eager in tests/test_engine_parity.py), the quality gate's known-answer
questions, and the single-stream and quantization benchmarks (which time its steps).

Each iteration runs up to `max_batch_size` unfinished sequences: first one backend call for
every decoding sequence (one token each), then calls for the next prefill chunk of every
sequence still prefilling, `prefill_batch` sequences per call. Decodes and prefills go in
separate calls because the graph takes a padded [batch, step] layout: padding decodes to a
prefill chunk's length would multiply their cost by the chunk length. How the work is split
into calls matters beyond speed: a backend may run different batch shapes through different
code (the CPU backend runs a lone sequence through the whole graph), so callers that compare
numbers across runs keep their split fixed.

KV blocks come from a free list over the backend's pool: a sequence takes blocks as it grows
and gives them back when it finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from executors.base import EngineBackend, SequenceChunk

StepKind = Literal["prefill", "decode"]


class OutOfBlocks(RuntimeError):
    """The backend's KV pool cannot hold the sequences running together."""


class GreedyStep(NamedTuple):
    """One backend call of the loop, for timing (time.perf_counter() seconds)."""

    kind: StepKind
    sequences: int  # chunks in the call
    tokens: int  # input tokens in the call
    start: float  # before the call's chunks were made
    end: float  # after its logits were turned into tokens


def phase_seconds(steps: Sequence[GreedyStep], kind: StepKind) -> float:
    """Wall time from the start of the first `kind` step to the end of the last (0.0: none).

    Meaningful when the phases do not interleave: every prompt prefilled whole in the first
    iteration, as the benchmarks run it."""
    timed = [s for s in steps if s.kind == kind]
    return timed[-1].end - timed[0].start if timed else 0.0


@dataclass
class _Sequence:
    token_ids: list[int]
    prompt_len: int
    computed: int = 0  # tokens whose K/V are in the pool
    blocks: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def decoding(self) -> bool:
        return len(self.token_ids) > self.prompt_len


def greedy_generate(
    backend: EngineBackend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Collection[int] = (),
    *,
    prefill_chunk: int | None = None,
    prefill_batch: int | None = None,
    max_batch_size: int | None = None,
    on_step: Callable[[GreedyStep], None] | None = None,
) -> list[list[int]]:
    """Greedy-decode every prompt; returns each one's generated token ids (a stop token included).

    A sequence stops at a token in `stop_token_ids` or after `max_new_tokens` tokens.
    prefill_chunk: prompt tokens per sequence per call (None: the whole prompt at once).
    prefill_batch: sequences per prefill call (None: every prefilling sequence in one call).
    max_batch_size: unfinished sequences run at a time, in prompt order (None: the engine's
        max_batch_size); later prompts start as earlier ones finish.
    on_step: called after every backend call with its timing.
    Raises OutOfBlocks when the backend's pool cannot hold the running sequences."""
    config = backend.config
    limit = config.max_batch_size if max_batch_size is None else max_batch_size
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    for name, value in (("prefill_chunk", prefill_chunk), ("prefill_batch", prefill_batch), ("max_batch_size", limit)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")
    seqs = [_Sequence(list(p), len(p)) for p in prompts]
    for seq in seqs:
        if not seq.token_ids or seq.prompt_len + max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"prompt of {seq.prompt_len} tokens + max_new_tokens {max_new_tokens} must be "
                f"1..{config.max_seq_len} tokens (the engine's max_seq_len)"
            )
    stops = frozenset(stop_token_ids)
    free_blocks = list(range(backend.num_blocks - 1, -1, -1))  # pop() hands out the lowest id

    def chunk(seq: _Sequence, end: int) -> SequenceChunk:
        """The sequence's tokens computed..end, with blocks reserved to hold them."""
        while len(seq.blocks) * config.block_size < end:
            if not free_blocks:
                raise OutOfBlocks(f"KV pool of {backend.num_blocks} blocks is full")
            seq.blocks.append(free_blocks.pop())
        return SequenceChunk(seq.token_ids[seq.computed : end], seq.computed, seq.blocks)

    def run(kind: StepKind, group: list[_Sequence], ends: list[int]) -> None:
        """One backend call; a sequence whose every token is then computed gets its next token."""
        start = time.perf_counter()
        chunks = [chunk(seq, end) for seq, end in zip(group, ends, strict=True)]
        for seq, row, end in zip(group, backend.step(chunks), ends, strict=True):
            seq.computed = end
            if end < len(seq.token_ids):
                continue  # a prompt chunk short of the prompt's end: its logits are not needed
            token = int(np.argmax(row))
            seq.token_ids.append(token)
            if token in stops or len(seq.token_ids) - seq.prompt_len >= max_new_tokens:
                seq.done = True
                free_blocks.extend(reversed(seq.blocks))
                seq.blocks.clear()
        if on_step is not None:
            tokens = sum(len(c.token_ids) for c in chunks)
            on_step(GreedyStep(kind, len(chunks), tokens, start, time.perf_counter()))

    while active := [s for s in seqs if not s.done][:limit]:
        decoding = [s for s in active if s.decoding]
        prefilling = [s for s in active if not s.decoding]
        if decoding:
            run("decode", decoding, [s.computed + 1 for s in decoding])
        per_call = prefill_batch or max(1, len(prefilling))
        for i in range(0, len(prefilling), per_call):
            group = prefilling[i : i + per_call]
            run("prefill", group, [min(s.prompt_len, s.computed + (prefill_chunk or s.prompt_len)) for s in group])
    return [s.token_ids[s.prompt_len :] for s in seqs]

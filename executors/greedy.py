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

The loop is written on executors/greedy_runner.py (sequences, their KV blocks, one call's argmax
tokens), which the draft-engine proposer reuses; this module keeps the policy above: the call split,
the stops, the order in which prompts start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Literal, NamedTuple

from executors.base import EngineBackend
from executors.greedy_runner import GreedyRunner

StepKind = Literal["prefill", "decode"]


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
    Raises OutOfBlocks (executors/greedy_runner.py) when the backend's pool cannot hold the running
    sequences."""
    config = backend.config
    limit = config.max_batch_size if max_batch_size is None else max_batch_size
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    for name, value in (("prefill_chunk", prefill_chunk), ("prefill_batch", prefill_batch), ("max_batch_size", limit)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")
    for prompt in prompts:
        if not prompt or len(prompt) + max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} must be "
                f"1..{config.max_seq_len} tokens (the engine's max_seq_len)"
            )
    stops = frozenset(stop_token_ids)
    runner = GreedyRunner(backend)
    seqs = [runner.extend(i, prompt) for i, prompt in enumerate(prompts)]
    outputs: list[list[int] | None] = [None] * len(prompts)  # a finished sequence's generated tokens

    def run(kind: StepKind, group: list[int], ends: list[int]) -> None:
        """One backend call; a sequence that reaches a stop token or max_new_tokens is released."""
        start = time.perf_counter()
        result = runner.step(list(zip(group, ends, strict=True)))
        for i, token in zip(group, result.tokens, strict=True):
            generated = len(seqs[i].tokens) - len(prompts[i])
            if token is not None and (token in stops or generated >= max_new_tokens):
                outputs[i] = seqs[i].tokens[len(prompts[i]) :]
                runner.release(i)
        if on_step is not None:
            tokens = sum(len(c.token_ids) for c in result.chunks)
            on_step(GreedyStep(kind, len(result.chunks), tokens, start, time.perf_counter()))

    while active := [i for i, out in enumerate(outputs) if out is None][:limit]:
        decoding = [i for i in active if len(seqs[i].tokens) > len(prompts[i])]
        prefilling = [i for i in active if len(seqs[i].tokens) == len(prompts[i])]
        if decoding:
            run("decode", decoding, [seqs[i].computed + 1 for i in decoding])
        per_call = prefill_batch or max(1, len(prefilling))
        for j in range(0, len(prefilling), per_call):
            group = prefilling[j : j + per_call]
            run("prefill", group, [min(len(prompts[i]), seqs[i].computed + (prefill_chunk or len(prompts[i])))
                                   for i in group])  # fmt: skip
    return [out for out in outputs if out is not None]  # all of them: the loop ran until none was left

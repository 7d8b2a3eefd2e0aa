"""The persistent batch (executors/block_table_rows.py): every step the engine runs, packed from the slots' rows,
must equal the same step packed from the chunks' own tables (the path before it), whatever changes the rows:
admissions, finishes, preemption under a small pool, aborts, speculative drafts and their trims, overlapped
launches. The engine runs over tests/test_overlap.py's stand-in device, here packing each step both ways
(model.HostStep, as the torch backend does) and comparing them; a corrupted row is caught by that comparison.
The torch backend's own run through the rows, token for token, is in tests/test_torch_backend.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from engine_format import EngineConfig
from executors.base import SequenceChunk
from executors.block_table_rows import BlockTableRows
from executors.sampling import DeviceSample, SamplingParams, SamplingState
from executors.torch.model import HostStep
from runtime.engine.engine_args import EngineArgs
from runtime.engine.llm_engine import LLMEngine
from tests.test_overlap import PROMPTS, FakeDevice, Launched, next_token, run


def cyclic_token(token: int, position: int, vocab: int) -> int:
    """A model that mostly repeats itself (period 7, a skip every 11th position): n-gram drafts are accepted,
    and now and then rejected."""
    return 3 + (token + 1 + (position % 11 == 0)) % 7


class PackingDevice(FakeDevice):
    """FakeDevice that packs every step through its persistent batch and from the chunks, and compares.
    `step` (speculative verify steps) returns logits whose argmax is the next token at every logit row."""

    def __init__(self, config: EngineConfig, num_blocks: int, next_token=next_token) -> None:
        super().__init__(config, num_blocks)
        self.next_token = next_token
        self.rows = BlockTableRows(config.max_batch_size, config.max_blocks_per_seq)
        self.chunk_steps = 0  # chunks packed with a slot

    def check(self, chunks: Sequence[SequenceChunk], placeholders: np.ndarray | None = None) -> None:
        assert all(c.slot is not None for c in chunks), "every engine chunk has a slot"
        slots = [c.slot for c in chunks]
        assert len(set(slots)) == len(slots), "one slot per running sequence"
        persistent = HostStep.pack(chunks, self.config, self.num_blocks, placeholders, rows=self.rows)
        fresh = HostStep.pack(chunks, self.config, self.num_blocks, placeholders)
        assert dataclasses.replace(persistent, packed=fresh.packed) == fresh
        np.testing.assert_array_equal(persistent.packed, fresh.packed)
        self.chunk_steps += len(chunks)

    def step(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        self.check(chunks)
        rows = []
        for c in chunks:
            tokens = list(c.token_ids)
            for k in range(len(tokens) - c.num_logits, len(tokens)):
                row = np.zeros(self.vocab, np.float32)
                row[self.next_token(tokens[k], c.past_len + k, self.vocab)] = 10.0
                rows.append(row)
        return np.stack(rows)

    def _sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None],
                tokens_in: list[int]) -> np.ndarray:  # fmt: skip
        last = [c.past_len + len(c.token_ids) - 1 for c in chunks]
        return np.array([-1 if row is None else self.next_token(t, p, self.vocab)
                         for t, p, row in zip(tokens_in, last, rows, strict=True)], np.int64)  # fmt: skip

    def step_sample(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None]) -> DeviceSample:
        self.check(chunks)
        return super().step_sample(chunks, rows)

    def launch(self, chunks: Sequence[SequenceChunk], rows: Sequence[SamplingState | None], sources: np.ndarray,
               previous: Launched | None) -> Launched:  # fmt: skip
        self.check(chunks, sources >= 0)
        return super().launch(chunks, rows, sources, previous)


def engine(llama_engine, num_blocks: int = 64, next_token=next_token, **args) -> tuple[LLMEngine, PackingDevice]:
    device = PackingDevice(EngineConfig.load(llama_engine), num_blocks, next_token)
    engine_args = EngineArgs(num_kv_blocks=num_blocks, itl_target_ms=None, **args)
    return LLMEngine(llama_engine, engine_args, backend=device), device


PARAMS = [
    SamplingParams(temperature=0, max_tokens=10 + 7 * (i % 4), ignore_eos=i % 2 == 0) for i in range(len(PROMPTS))
]
ABORTS = {1: 3, 4: 5, 7: 1}


@pytest.mark.parametrize("overlap", [False, True])
def test_every_step_packs_alike_under_admissions_finishes_preemption_and_aborts(llama_engine, overlap):
    expected = run(engine(llama_engine, overlap_scheduling=False)[0], PROMPTS, PARAMS, ABORTS)
    eng, device = engine(llama_engine, num_blocks=16, overlap_scheduling=overlap)
    assert run(eng, PROMPTS, PARAMS, ABORTS) == expected
    assert eng.scheduler.num_preemptions > 0 and (device.launches > 0) == overlap
    # O(changes): a row is copied when its sequence arrives or gains a block, not every step
    assert 0 < device.rows.rewrites < device.chunk_steps / 3, (device.rows.rewrites, device.chunk_steps)


def test_every_step_packs_alike_with_speculative_drafts(llama_engine):
    """N-gram drafts over the repetitive prompts: verify chunks of several tokens, trims of rejected drafts."""
    expected = run(engine(llama_engine, next_token=cyclic_token)[0], PROMPTS, PARAMS)
    eng, _ = engine(llama_engine, 24, cyclic_token, speculative="ngram", num_speculative_tokens=3)
    assert run(eng, PROMPTS, PARAMS) == expected
    assert eng.spec is not None
    spec = eng.spec.counters.snapshot()
    assert spec.draft_tokens > spec.accepted_tokens > 0, "drafts accepted and rejected (trimmed)"


def test_the_comparison_catches_a_corrupted_row(llama_engine):
    eng, device = engine(llama_engine, overlap_scheduling=False)
    for prompt, params in zip(PROMPTS[:4], PARAMS, strict=False):
        eng.add_request(prompt, params)
    for _ in range(3):
        eng.step()
    request = next(iter(eng.scheduler.running))
    device.rows.tables[request.slot, 0] += 1  # another block of the pool: valid, wrong
    failed = eng.step()  # the engine fails the step's requests with the backend's error
    assert len(failed) == 4
    assert all(o.finish_reason == "error" and "Arrays are not equal" in (o.error or "") for o in failed)


def test_rows_refuse_a_slot_outside_the_batch_or_a_table_too_wide():
    rows = BlockTableRows(4, 3)
    with pytest.raises(ValueError, match="slot 4 is outside"):
        rows.gather([SequenceChunk([1], 0, [0], slot=4)], [4], 1)
    with pytest.raises(ValueError, match="4 blocks, more than a sequence holds"):
        rows.gather([SequenceChunk([1], 0, [0, 1, 2, 3], slot=0)], [0], 1)
    table = [5, 6]
    got = rows.gather([SequenceChunk([1], 20, table, slot=2)], [2], 3)
    assert got.tolist() == [[5, 6, 0]] and rows.rewrites == 1
    rows.gather([SequenceChunk([1], 21, table, slot=2)], [2], 2)
    assert rows.rewrites == 1, "the same list: no copy"
    assert rows.gather([SequenceChunk([1], 40, [5, 6, 9], slot=2)], [2], 3).tolist() == [[5, 6, 9]]
    assert rows.gather([SequenceChunk([1], 0, [7], slot=2)], [2], 3).tolist() == [[7, 0, 0]], "a new occupant"

"""HostStep.pack and check_chunks (vectorized over the batch) against plain per-chunk loops written here:
the packed layout for random mixes of prefill, decode and verify chunks, with and without placeholders;
every refusal naming the first bad chunk, with the first check that chunk fails."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from engine_format import EngineConfig, ModelSpec
from executors.base import SequenceChunk
from executors.device_sampling import PLACEHOLDER, check_chunks
from executors.torch.model import HostStep

SPEC = ModelSpec(
    model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True, qkv_bias=False, rope_type="default",
    max_position_embeddings=256, sliding_windows=(None, None), bos_token_id=1, eos_token_ids=(2,),
)  # fmt: skip
CONFIG = EngineConfig(Path("."), "onnxruntime-cpu", "float32", 8, 64, 256, SPEC)
BS, VOCAB, MAX_SEQ = CONFIG.block_size, SPEC.vocab_size, CONFIG.max_seq_len
NUM_BLOCKS = 100


def reference_pack(chunks: Sequence[SequenceChunk]) -> tuple[list[int], int, int, int, int, int]:
    """The packed regions, token by token: ids, positions, slot blocks, slot offsets, query_start,
    logit rows, block tables (each padded with zeros to the widest need)."""
    needs = [-(-(c.past_len + len(c.token_ids)) // BS) for c in chunks]
    width = max(needs)
    ids, positions, blocks, offsets, query_start, rows, tables = [], [], [], [], [0], [], []
    for c, need in zip(chunks, needs, strict=True):
        table = [int(b) for b in c.block_table[:need]] + [0] * (width - need)
        for j, token in enumerate(c.token_ids):
            position = c.past_len + j
            ids.append(int(token))
            positions.append(position)
            blocks.append(table[position // BS])
            offsets.append(position % BS)
        start, n = query_start[-1], len(c.token_ids)
        rows.extend(range(start + n - c.num_logits, start + n))
        query_start.append(start + n)
        tables.extend(table)
    packed = ids + positions + blocks + offsets + query_start + rows + tables
    return packed, len(ids), len(chunks), width, max(len(c.token_ids) for c in chunks), len(rows)


def reference_check(chunks: Sequence[SequenceChunk], placeholders: Sequence[bool] | None = None) -> str | None:
    """The refusal message, chunk by chunk and check by check (None: the step is fine)."""
    if not chunks:
        return "a step needs at least one chunk"
    for i, c in enumerate(chunks):
        n, end = len(c.token_ids), c.past_len + len(c.token_ids)
        if n < 1 or c.past_len < 0 or end > MAX_SEQ:
            return f"chunk {i}: {n} tokens after past_len {c.past_len} must fit in 1..{MAX_SEQ} positions"
        if not 1 <= c.num_logits <= n:
            return f"chunk {i}: num_logits {c.num_logits} must be in 1..{n} (its tokens)"
        need = -(-end // BS)
        if len(c.block_table) < need:
            return f"chunk {i}: block table of {len(c.block_table)} blocks covers {len(c.block_table) * BS} positions, {end} needed"  # noqa: E501
        outside = [b for b in c.block_table[:need] if not 0 <= b < NUM_BLOCKS]
        if outside:
            return f"chunk {i}: block table names block {outside[0]}, outside the pool (0..{NUM_BLOCKS - 1})"
        ids = list(c.token_ids)
        if placeholders is not None and placeholders[i]:
            if ids[0] != PLACEHOLDER:
                return f"chunk {i}: its first token should be the previous launch's (PLACEHOLDER)"
            ids = ids[1:]
        if ids and not all(0 <= t < VOCAB for t in ids):
            return f"chunk {i}: token ids must be in [0, {VOCAB}) (got {min(ids)}..{max(ids)})"
    return None


def table(rng: np.random.Generator, need: int, extra: int = 0) -> Sequence[int]:
    """Distinct blocks from the pool, `extra` more than needed, as a list, tuple or numpy array."""
    blocks = rng.choice(NUM_BLOCKS, need + extra, replace=False)
    kind = rng.integers(3)
    return blocks.tolist() if kind == 0 else tuple(int(b) for b in blocks) if kind == 1 else blocks.astype(np.int32)


def good_chunk(rng: np.random.Generator, kind: str | None = None, placeholder: bool = False) -> SequenceChunk:
    """A valid prefill, decode or verify (num_logits > 1) chunk, its table up to 3 blocks longer than needed."""
    kind = kind or str(rng.choice(["prefill", "decode", "verify"]))
    n = {"prefill": int(rng.integers(1, 40)), "decode": 1, "verify": int(rng.integers(2, 6))}[kind]
    past = int(rng.integers(0, MAX_SEQ - n + 1))
    num_logits = n if kind == "verify" else 1 if kind == "decode" else int(rng.integers(1, n + 1))
    ids = rng.integers(0, VOCAB, n).tolist()
    if placeholder:
        ids[0] = PLACEHOLDER
    need = -(-(past + n) // BS)
    return SequenceChunk(ids, past, table(rng, need, int(rng.integers(0, min(4, NUM_BLOCKS - need + 1)))), num_logits)


def assert_packs_as_reference(chunks: list[SequenceChunk], placeholders: np.ndarray | None) -> None:
    step = HostStep.pack(chunks, CONFIG, NUM_BLOCKS, placeholders)
    packed, tokens, batch, width, max_rows, rows = reference_pack(chunks)
    assert step.packed.dtype == np.int64
    assert step.packed.tolist() == packed
    assert (step.tokens, step.batch, step.table_width) == (tokens, batch, width)
    assert (step.max_rows, step.rows) == (max_rows, rows)


@pytest.mark.parametrize("with_placeholders", [False, True])
def test_pack_matches_a_per_chunk_loop(with_placeholders: bool) -> None:
    rng = np.random.default_rng(7)
    for trial in range(300):
        batch = int(rng.integers(1, 20))
        only = "decode" if trial % 4 == 0 else None  # decode-only steps: the layout's fast path
        marks = rng.random(batch) < 0.5 if with_placeholders else np.zeros(batch, bool)
        chunks = [good_chunk(rng, only, bool(m)) for m in marks]
        assert_packs_as_reference(chunks, marks if with_placeholders else None)


def test_pack_one_token_placeholder_chunks_and_tables_bad_past_their_need() -> None:
    """A one-token placeholder chunk has no token id to check; blocks past a table's need are not read."""
    chunks = [
        SequenceChunk([PLACEHOLDER], 7, [3]),
        SequenceChunk([5, 6], 8, [4, 9, -1, 10_000]),
        SequenceChunk([PLACEHOLDER, 1, 2], 0, np.array([0, 99, -5])),
    ]
    assert_packs_as_reference(chunks, np.array([True, False, True]))
    assert reference_check(chunks, [True, False, True]) is None


BadChunk = Callable[[], SequenceChunk]
TOKENS_OUTSIDE = r"token ids must be in \[0, 512\) \(got {}\)"
ERRORS: dict[str, tuple[BadChunk, str]] = {  # a bad chunk, the message (a regex) after "chunk {i}: "
    "no tokens": (lambda: SequenceChunk([], 5, [1]), r"0 tokens after past_len 5 must fit in 1\.\.256 positions"),
    "negative past_len": (lambda: SequenceChunk([1, 2], -1, [1]), r"2 tokens after past_len -1 must fit in"),
    "past max_seq_len": (lambda: SequenceChunk([1, 2, 3], 254, list(range(40))), r"3 tokens after past_len 254"),
    "no logits": (lambda: SequenceChunk([1, 2], 0, [1], 0), r"num_logits 0 must be in 1\.\.2 \(its tokens\)"),
    "too many logits": (lambda: SequenceChunk([1, 2], 0, [1], 3), r"num_logits 3 must be in 1\.\.2 \(its tokens\)"),
    "short table": (lambda: SequenceChunk([1, 2], 7, [4]), r"block table of 1 blocks covers 8 positions, 9 needed"),
    "negative block": (
        lambda: SequenceChunk([1], 9, [4, -3, -4]),
        r"block table names block -3, outside the pool \(0\.\.99\)",
    ),
    "block past the pool": (lambda: SequenceChunk([1], 3, (100,)), r"block table names block 100, outside the pool"),
    "negative token": (lambda: SequenceChunk([7, -3, 4], 0, [1]), TOKENS_OUTSIDE.format(r"-3\.\.7")),
    "token past the vocabulary": (lambda: SequenceChunk([512, 0], 0, [1]), TOKENS_OUTSIDE.format(r"0\.\.512")),
    "unmarked PLACEHOLDER": (lambda: SequenceChunk([PLACEHOLDER], 4, [1]), TOKENS_OUTSIDE.format(r"-1\.\.-1")),
}
PLACEHOLDER_ERRORS: dict[str, tuple[BadChunk, str]] = {  # the bad chunk is a placeholder chunk
    "first token not PLACEHOLDER": (
        lambda: SequenceChunk([3, 4], 0, [1]),
        r"its first token should be the previous launch's \(PLACEHOLDER\)",
    ),
    "a bad token after PLACEHOLDER": (
        lambda: SequenceChunk([PLACEHOLDER, 9, 600], 0, [1]),
        TOKENS_OUTSIDE.format(r"9\.\.600"),
    ),
}
ALL_ERRORS = {**ERRORS, **PLACEHOLDER_ERRORS}
REFUSERS = {
    "check_chunks": lambda chunks, marks: check_chunks(chunks, CONFIG, NUM_BLOCKS, marks),
    "pack": lambda chunks, marks: HostStep.pack(chunks, CONFIG, NUM_BLOCKS, marks),
}


def refused(refuse: str, chunks: list[SequenceChunk], marks: np.ndarray | None) -> str:
    with pytest.raises(ValueError) as error:
        REFUSERS[refuse](chunks, marks)
    return str(error.value)


@pytest.mark.parametrize("refuse", REFUSERS)
def test_an_empty_step_is_refused(refuse: str) -> None:
    assert refused(refuse, [], None) == "a step needs at least one chunk"


@pytest.mark.parametrize("refuse", REFUSERS)
@pytest.mark.parametrize("case", ALL_ERRORS)
def test_a_bad_chunk_among_good_ones_is_named(refuse: str, case: str) -> None:
    rng = np.random.default_rng(len(case))
    bad, message = ALL_ERRORS[case]
    chunks = [good_chunk(rng, placeholder=bool(i % 2)) for i in range(9)]
    marks = np.arange(9) % 2 == 1
    marks[4] = case in PLACEHOLDER_ERRORS
    chunks[4] = bad()
    got = refused(refuse, chunks, marks)
    assert re.fullmatch(rf"chunk 4: {message}.*", got), got
    assert got == reference_check(chunks, marks.tolist())


@pytest.mark.parametrize("refuse", REFUSERS)
@pytest.mark.parametrize("case", ALL_ERRORS)
def test_of_two_bad_chunks_the_first_is_named(refuse: str, case: str) -> None:
    """Chunk 2 is bad by `case`, chunk 6 by each case in turn (its check before, the same as, or after case's)."""
    rng = np.random.default_rng(len(case))
    bad, message = ALL_ERRORS[case]
    for later, (other, _) in ALL_ERRORS.items():
        chunks = [good_chunk(rng) for _ in range(8)]
        marks = np.zeros(8, bool)
        chunks[2], marks[2] = bad(), case in PLACEHOLDER_ERRORS
        chunks[6], marks[6] = other(), later in PLACEHOLDER_ERRORS
        got = refused(refuse, chunks, marks)
        assert re.fullmatch(rf"chunk 2: {message}.*", got), (later, got)


def test_a_chunk_failing_several_checks_is_refused_by_the_first() -> None:
    """A chunk's checks run in order: tokens and positions, logit rows, table length, blocks, placeholder, ids."""
    cases = [
        (SequenceChunk([], 0, [-1], num_logits=0), r"0 tokens after past_len 0"),
        (SequenceChunk([600, 1], 0, [], num_logits=3), r"num_logits 3 must be in 1\.\.2"),
        (SequenceChunk([600, 1], 15, [-1]), r"block table of 1 blocks covers 8 positions, 17 needed"),
        (SequenceChunk([600, 1], 15, [2, 100, 7]), r"block table names block 100"),
        (SequenceChunk([600, 1], 15, [2, 7, 9, -1]), r"token ids must be in \[0, 512\) \(got 1\.\.600\)"),
    ]
    for bad, message in cases:
        for marks in (None, np.array([False, False, False])):
            got = refused("pack", [SequenceChunk([1], 0, [0]), bad, SequenceChunk([1], 0, [-2])], marks)
            assert re.fullmatch(rf"chunk 1: {message}.*", got), got
    got = refused("pack", [SequenceChunk([1], 0, [0]), SequenceChunk([600, 1], 15, [2, 7, 9])], np.array([False, True]))
    assert got == "chunk 1: its first token should be the previous launch's (PLACEHOLDER)"


@pytest.mark.parametrize("with_placeholders", [False, True])
def test_random_defects_are_named_as_the_per_chunk_loop_names_them(with_placeholders: bool) -> None:
    rng = np.random.default_rng(11)
    bad_chunks = list(ERRORS.values()) + (list(PLACEHOLDER_ERRORS.values()) if with_placeholders else [])
    for _ in range(200):
        batch = int(rng.integers(1, 12))
        marks = rng.random(batch) < 0.4 if with_placeholders else np.zeros(batch, bool)
        chunks = [good_chunk(rng, placeholder=bool(m)) for m in marks]
        for i in rng.choice(batch, min(batch, int(rng.integers(0, 3))), replace=False):
            chunks[i] = bad_chunks[rng.integers(len(bad_chunks))][0]()
        want = reference_check(chunks, marks.tolist() if with_placeholders else None)
        placeholders = marks if with_placeholders else None
        if want is None:
            assert_packs_as_reference(chunks, placeholders)
        else:
            assert refused("pack", chunks, placeholders) == want
            assert refused("check_chunks", chunks, placeholders) == want

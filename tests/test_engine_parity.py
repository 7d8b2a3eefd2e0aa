"""The exported engine on ONNX Runtime CPU against HF eager, for every tiny architecture.

Tolerance: both sides run float32; they differ only in summation order (fused QKV and
gate/up matmuls, the Attention kernel), measured at ~3e-6 on these models whose logits
reach ~4. ATOL = 1e-4 leaves 30x headroom and sits far below what any real fault gives (a
mask, position or KV-slot error moves logits by O(0.1..1), see test_wrong_block_table).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from builder.sources import load_checkpoint, resolve_model
from engine_format import EngineConfig
from executors import create_backend
from executors.base import SequenceChunk
from executors.flat_step import FlatStep
from executors.greedy import GreedyStep, greedy_generate, phase_seconds
from executors.greedy_runner import OutOfBlocks
from executors.ort_cpu import runs_whole_graph
from tests.conftest import TINY_BLOCK_SIZE
from tests.helpers import hf_greedy, hf_logits, random_prompts

ATOL = 1e-4
BS = TINY_BLOCK_SIZE


@pytest.fixture(scope="module", params=["graph", "plugin", "cpu"])
def kind(request) -> str:
    """Every check runs on the portable graph, the TensorRT plugin graph (plugin ops through
    their reference bodies) and the CPU backend (segments + kernel)."""
    return request.param


@pytest.fixture(scope="module")
def backend(tiny_engine, kind):
    return create_backend(EngineConfig.load(tiny_engine), num_blocks=64, kind=kind)


def blocks(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_prefill_and_decode_match_hf(backend, tiny_hf):
    model, _ = tiny_hf
    tokens = random_prompts(backend.config.model.vocab_size, [43])[0]
    ref = hf_logits(model, tokens)
    table = blocks(0, 6)
    got = backend.step([SequenceChunk(tokens[:40], 0, table)])[0]
    np.testing.assert_allclose(got, ref[39], atol=ATOL)
    for pos in range(40, 43):  # three decode steps read the pool written by prefill
        got = backend.step([SequenceChunk([tokens[pos]], pos, table)])[0]
        np.testing.assert_allclose(got, ref[pos], atol=ATOL)


@pytest.mark.parametrize("chunk", [1, 5, BS, 13, 2 * BS + 3])
def test_chunked_prefill_equals_one_shot(backend, tiny_hf, chunk):
    model, _ = tiny_hf
    tokens = random_prompts(backend.config.model.vocab_size, [50], seed=chunk)[0]
    table = blocks(10, 7)
    for start in range(0, len(tokens), chunk):
        got = backend.step([SequenceChunk(tokens[start : start + chunk], start, table)])[0]
    np.testing.assert_allclose(got, hf_logits(model, tokens)[-1], atol=ATOL)


def test_prompt_whose_prefix_sits_in_pool(backend, tiny_hf):
    """Sequence B shares A's first 4 full blocks: computing only B's suffix over A's blocks
    gives the same logits as B prefilled from scratch."""
    model, _ = tiny_hf
    vocab = backend.config.model.vocab_size
    a = random_prompts(vocab, [45], seed=3)[0]
    b = a[: 4 * BS] + random_prompts(vocab, [11], seed=4)[0]
    table_a = blocks(20, 6)
    backend.step([SequenceChunk(a, 0, table_a)])
    table_b = table_a[:4] + blocks(30, 2)
    shared = backend.step([SequenceChunk(b[4 * BS :], 4 * BS, table_b)])[0]
    fresh = backend.step([SequenceChunk(b, 0, blocks(40, 6))])[0]
    np.testing.assert_allclose(shared, fresh, atol=ATOL)
    np.testing.assert_allclose(shared, hf_logits(model, b)[-1], atol=ATOL)


def test_ragged_batch_equals_single_sequences(backend, tiny_hf):
    """Chunks of different lengths and past lengths in one padded call."""
    model, _ = tiny_hf
    vocab = backend.config.model.vocab_size
    seqs = random_prompts(vocab, [9, 30, 17], seed=7)
    tables = [blocks(0, 2), blocks(2, 4), blocks(6, 3)]
    backend.step([SequenceChunk(s[:-5], 0, t) for s, t in zip(seqs, tables, strict=True)])
    # Each sequence now has 5 tokens left: run 1, 4 and 0-past styles mixed.
    chunks = [SequenceChunk(s[-5:], len(s) - 5, t) for s, t in zip(seqs, tables, strict=True)]
    chunks[0] = SequenceChunk(seqs[0][-5:-4], len(seqs[0]) - 5, tables[0])
    got = backend.step(chunks)
    np.testing.assert_allclose(got[0], hf_logits(model, seqs[0][:-4])[-1], atol=ATOL)
    np.testing.assert_allclose(got[1], hf_logits(model, seqs[1])[-1], atol=ATOL)
    np.testing.assert_allclose(got[2], hf_logits(model, seqs[2])[-1], atol=ATOL)


def test_wrong_block_table_is_detected(backend, tiny_hf):
    """The comparison can fail: decoding over a block that holds other data is caught.

    (Merely reordering a sequence's own blocks would not be: keys carry their RoPE and
    attention over a set of keys is order-invariant.)"""
    model, _ = tiny_hf
    tokens = random_prompts(backend.config.model.vocab_size, [33], seed=11)[0]
    backend.step([SequenceChunk(tokens[:32], 0, blocks(50, 5))])
    wrong = backend.step([SequenceChunk([tokens[32]], 32, [50, 60, 52, 53, 54])])[0]
    assert np.abs(wrong - hf_logits(model, tokens)[-1]).max() > 100 * ATOL


def test_greedy_generate_matches_hf_generate(tiny_engine, tiny_hf, kind):
    """20 prompts of varied lengths, batched (max_batch_size 8) with chunked prefill."""
    model, tokenizer = tiny_hf
    config = EngineConfig.load(tiny_engine)
    backend = create_backend(config, kind=kind)
    lengths = [1, 2, 3, 5, 7, 8, 9, 12, 16, 17, 24, 31, 33, 40, 47, 64, 65, 80, 99, 120]
    prompts = random_prompts(config.model.vocab_size, lengths, seed=5)
    stop = (tokenizer.eos_token_id,)
    got = greedy_generate(backend, prompts, max_new_tokens=16, stop_token_ids=stop, prefill_chunk=24)
    want = [hf_greedy(model, p, 16, stop) for p in prompts]
    assert got == want
    assert all(len(g) > 0 for g in got)


def test_greedy_call_split_and_step_records(llama_engine):
    """prefill_batch and max_batch_size change only how the work is split into backend calls
    (reported in order through on_step), not the tokens."""
    model, tokenizer = load_checkpoint(resolve_model("tiny-llama"))
    config = EngineConfig.load(llama_engine)
    backend = create_backend(config, num_blocks=64, kind="graph")
    prompts = random_prompts(config.model.vocab_size, [5, 30, 12], seed=19)
    stop = (tokenizer.eos_token_id,)
    steps: list[GreedyStep] = []
    got = greedy_generate(backend, prompts, 6, stop, prefill_batch=1, max_batch_size=2, on_step=steps.append)
    assert got == [hf_greedy(model, p, 6, stop) for p in prompts]
    assert all(len(g) == 6 for g in got)  # no stop token met: the call pattern below is exact
    # Prompts 0 and 1 run together (one prefill call each, then 5 decodes of both); prompt 2 after.
    first, second = [("prefill", 1, 5), ("prefill", 1, 30)] + [("decode", 2, 2)] * 5, [("prefill", 1, 12)]
    assert [(s.kind, s.sequences, s.tokens) for s in steps] == first + second + [("decode", 1, 1)] * 5
    assert all(a.start <= a.end <= b.start for a, b in itertools.pairwise(steps))
    assert phase_seconds(steps, "decode") == steps[-1].end - steps[2].start
    # The default split: both prompts' first chunks in one call, then decodes and prefill chunks.
    steps.clear()
    assert greedy_generate(backend, prompts[:2], 6, stop, prefill_chunk=16, on_step=steps.append) == got[:2]
    assert [(s.kind, s.sequences, s.tokens) for s in steps][:3] == [("prefill", 2, 21), ("decode", 1, 1),
                                                                   ("prefill", 1, 14)]  # fmt: skip


def test_greedy_refuses_what_the_pool_or_engine_cannot_hold(llama_engine):
    config = EngineConfig.load(llama_engine)
    backend = create_backend(config, num_blocks=3, kind="graph")
    with pytest.raises(OutOfBlocks):
        greedy_generate(backend, [list(range(3, 30))], 4)  # 27 tokens need 4 blocks of 8
    for prompt, new in (([], 4), ([5] * config.max_seq_len, 1), ([5], 0)):
        with pytest.raises(ValueError):
            greedy_generate(backend, [prompt], new)


def test_step_with_more_tokens_than_max_seq_len(backend, tiny_hf):
    """A step may batch more tokens than one sequence can hold (3 x 100 > 256)."""
    model, _ = tiny_hf
    prompts = random_prompts(backend.config.model.vocab_size, [100, 100, 100], seed=13)
    tables = [blocks(0, 13), blocks(13, 13), blocks(26, 13)]
    got = backend.step([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    for row, prompt in zip(got, prompts, strict=True):
        np.testing.assert_allclose(row, hf_logits(model, prompt)[-1], atol=ATOL)


def test_cpu_backend_whole_graph_and_segment_steps_agree(tiny_engine):
    """The CPU backend runs small steps through the whole graph and the rest through the segments and
    kernel: both paths read and write the same pool and agree, on a batch and on lone sequences."""
    backend = create_backend(EngineConfig.load(tiny_engine), num_blocks=64, kind="cpu")
    assert backend.small_steps is not None
    a, b = random_prompts(backend.config.model.vocab_size, [20, 30], seed=17)
    backend.step([SequenceChunk(a, 0, blocks(0, 4)), SequenceChunk(b, 0, blocks(4, 4))])  # segments: 30 tokens
    decodes = [SequenceChunk([7], 20, blocks(0, 4)), SequenceChunk([9], 30, blocks(4, 4))]
    flat = FlatStep.pack(decodes, backend.config.block_size)
    by_segments = backend._run(flat, flat.logit_rows)
    by_graph = backend.small_steps.step(decodes)
    alone = [backend.step([chunk])[0] for chunk in decodes]
    np.testing.assert_allclose(by_graph, by_segments, atol=ATOL)
    np.testing.assert_allclose(np.stack(alone), by_segments, atol=ATOL)


def test_small_steps_take_the_whole_graph_and_the_rest_the_segments():
    decode = lambda past: SequenceChunk([1], past, [0])  # noqa: E731
    assert runs_whole_graph([SequenceChunk(list(range(500)), 0, [0])])  # one sequence, whatever it holds
    assert runs_whole_graph([decode(240)] * 4) and runs_whole_graph([SequenceChunk([1] * 5, 200, [0])] * 3)
    assert not runs_whole_graph([decode(100)] * 5)  # more sequences than GRAPH_MAX_SEQS
    assert not runs_whole_graph([decode(100)] * 3 + [decode(400)])  # padded to 4 x 401: the gathers cost more
    assert not runs_whole_graph([decode(10), SequenceChunk([1] * 20, 0, [0])])  # a prefill chunk: padding

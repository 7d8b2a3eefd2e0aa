"""The CPU paged-attention kernel against a straightforward numpy reference."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from engine_format import ceil_div
from executors.cpu_attention import AttentionShape, paged_attention


def reference(q, k_cache, v_cache, tables, seq_of_token, positions, shape, window=None):
    """Per token, per head: softmax over the visible keys of its sequence, gathered by hand."""
    heads, kv_heads, dim, bs = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    out = np.zeros_like(q)
    for t, (seq, pos) in enumerate(zip(seq_of_token, positions, strict=True)):
        keys = np.arange(0 if window is None else max(0, pos - window + 1), pos + 1)
        blocks = tables[seq][keys // bs]
        k = k_cache[blocks, keys % bs].reshape(len(keys), kv_heads, dim)
        v = v_cache[blocks, keys % bs].reshape(len(keys), kv_heads, dim)
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = k[:, g].astype(np.float64) @ q[t, h * dim : (h + 1) * dim] / np.sqrt(dim)
            p = np.exp(scores - scores.max())
            out[t, h * dim : (h + 1) * dim] = (p / p.sum()) @ v[:, g]
    return out


def make_case(rng, shape: AttentionShape, seqs: list[tuple[int, int]], num_blocks: int = 64):
    """seqs: (past_len, new_tokens) per sequence; returns the kernel's inputs, flat tokens."""
    width = shape.num_kv_heads * shape.head_dim
    k_cache = rng.standard_normal((num_blocks, shape.block_size, width), dtype=np.float32)
    v_cache = rng.standard_normal((num_blocks, shape.block_size, width), dtype=np.float32)
    need = [ceil_div(past + new, shape.block_size) for past, new in seqs]
    ids = rng.permutation(num_blocks)[: sum(need)]
    tables = np.zeros((len(seqs), max(need)), np.int64)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[start : start + n]
        start += n
    seq_of_token = np.concatenate([np.full(new, b) for b, (_, new) in enumerate(seqs)])
    positions = np.concatenate([np.arange(past, past + new) for past, new in seqs])
    q = rng.standard_normal((len(positions), shape.num_heads * shape.head_dim), dtype=np.float32)
    return q, k_cache, v_cache, tables, seq_of_token, positions


SHAPES = [
    AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=64),  # SmolLM2
    AttentionShape(num_heads=4, num_kv_heads=4, head_dim=16, block_size=8),  # MHA, small blocks
    AttentionShape(num_heads=8, num_kv_heads=1, head_dim=32, block_size=16),  # MQA
    AttentionShape(num_heads=32, num_kv_heads=2, head_dim=128, block_size=4),  # big groups
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.num_heads}kv{s.num_kv_heads}d{s.head_dim}b{s.block_size}")
@pytest.mark.parametrize("window", [None, 7])
def test_mixed_decodes_and_prefill_chunks_match_reference(shape, window):
    rng = np.random.default_rng(0)
    # decodes at various depths, a prefill from scratch, a chunk after a cached prefix
    seqs = [(0, 1), (5, 1), (37, 1), (0, 23), (19, 9), (64, 1)]
    args = make_case(rng, shape, seqs)
    got = paged_attention(*args, shape, window=window)
    np.testing.assert_allclose(got, reference(*args, shape, window=window), atol=2e-5)


def test_threads_do_not_change_the_result():
    shape = SHAPES[0]
    args = make_case(np.random.default_rng(1), shape, [(100, 1)] * 8 + [(0, 70)])
    one = paged_attention(*args, shape, threads=1)
    np.testing.assert_array_equal(one, paged_attention(*args, shape, threads=2))


def test_both_work_splits_give_the_same_rows():
    """A lone decode runs as one item per kv head; among 8 decodes its tile takes every kv head in turn
    (and prefetches its next block): the same numbers, matching the reference."""
    shape = SHAPES[0]
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(3), shape, [(300, 1)] * 8, num_blocks=48)
    many = paged_attention(q, k, v, tables, seqs, pos, shape, threads=2)
    alone = paged_attention(q[:1], k, v, tables[:1], seqs[:1], pos[:1], shape, threads=2)
    np.testing.assert_array_equal(alone[0], many[0])
    np.testing.assert_allclose(many, reference(q, k, v, tables, seqs, pos, shape), atol=2e-5)


def test_a_wrong_block_table_is_caught():
    """The comparison can fail: pointing one block elsewhere changes the output."""
    shape = SHAPES[1]
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(2), shape, [(30, 1)])
    want = reference(q, k, v, tables, seqs, pos, shape)
    broken = tables.copy()
    broken[0, 1] = (broken[0, 1] + 1) % k.shape[0]
    assert np.abs(paged_attention(q, k, v, broken, seqs, pos, shape) - want).max() > 1e-2


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: {**a, "q": a["q"].astype(np.float64)}, "q must be C-contiguous float32"),
        (lambda a: {**a, "q": np.asfortranarray(a["q"])}, "q must be C-contiguous float32"),
        (lambda a: {**a, "k_cache": a["k_cache"][:, :4]}, "k/v cache must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, message):
    shape = SHAPES[1]
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_of_token", "positions")
    args = dict(zip(names, make_case(np.random.default_rng(3), shape, [(3, 2)]), strict=True))
    with pytest.raises(ValueError, match=message):
        paged_attention(**mutate(args), shape=shape)


@pytest.mark.parametrize("torch_first", [False, True])
def test_engine_sets_the_openmp_wait_policy_before_libgomp_loads(llama_engine, torch_first):
    """libgomp reads OMP_WAIT_POLICY once, when first loaded; the kernel's threads must sleep
    between calls (spinning cost ~18% of served throughput). An engine created in a fresh
    process gets the policy in time; a script that imports torch first is warned."""
    script = ("import logging, sys; logging.basicConfig(stream=sys.stdout)\n"
              + ("import torch\n" if torch_first else "")
              + f"from runtime import LLMEngine\nLLMEngine({str(llama_engine)!r})\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert ("libgomp was loaded" in result.stdout) == torch_first, result.stdout

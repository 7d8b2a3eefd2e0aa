"""The plugin-layout Triton kernels (padded [batch, step], as the TensorRT plugin nodes see
them) on CPU under Triton's interpreter: PagedKVWrite against a per-row numpy loop, KV write
+ PagedAttention + PagedAttentionMerge against the numpy attention reference and against the
plugin ops' ONNX reference functions (run by ONNX Runtime). Their AOT compilation:
tests/test_plugin_kernels_aot.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from builder.onnx_graph import OPSET  # noqa: E402
from builder.plugin_functions import ATTENTION, DOMAIN, KV_WRITE, MERGE, reference_functions  # noqa: E402
from engine_format import ceil_div  # noqa: E402
from executors.cpu_attention import AttentionShape  # noqa: E402
from plugins_cuda.attention_launch import AttentionTiles, num_splits, paged_attention_padded  # noqa: E402
from plugins_cuda.kv_write import paged_kv_write  # noqa: E402
from tests.test_paged_attention import reference  # noqa: E402


def padded_case(rng, seqs: list[tuple[int, int]], kv_width: int, block_size: int, num_blocks: int = 48):
    """(past_len, new_tokens) per sequence -> padded step inputs, block tables covering the step."""
    batch, step = len(seqs), max(n for _, n in seqs)
    need = [ceil_div(past + n, block_size) for past, n in seqs]
    ids = rng.permutation(num_blocks)[: sum(need)]
    tables = np.zeros((batch, max(need)), np.int64)
    positions = np.zeros((batch, step), np.int64)
    for b, (past, n) in enumerate(seqs):
        tables[b, : need[b]] = ids[sum(need[:b]) : sum(need[: b + 1])]
        positions[b, :n] = np.arange(past, past + n)
        positions[b, n:] = past + n - 1  # padding repeats the last position
    k = rng.standard_normal((batch, step, kv_width), dtype=np.float32)
    v = rng.standard_normal((batch, step, kv_width), dtype=np.float32)
    pools = [rng.standard_normal((num_blocks, block_size, kv_width), dtype=np.float32) for _ in range(2)]
    seq_lens = np.array([n for _, n in seqs], np.int64)
    return k, v, pools, tables, positions, seq_lens


def write_reference(k, v, pools, tables, positions, seq_lens):
    """Row by row: only real rows move, each to its block-table slot."""
    k_pool, v_pool = (p.copy() for p in pools)
    block_size = k_pool.shape[1]
    for b in range(k.shape[0]):
        for i in range(seq_lens[b]):
            p = positions[b, i]
            block = tables[b, p // block_size]
            k_pool[block, p % block_size] = k[b, i]
            v_pool[block, p % block_size] = v[b, i]
    return k_pool, v_pool


def run_write(k, v, pools, tables, positions, seq_lens):
    k_pool, v_pool = (torch.from_numpy(p.copy()) for p in pools)
    args = [torch.from_numpy(x) for x in (k, v)] + [k_pool, v_pool]
    paged_kv_write(*args, *(torch.from_numpy(x) for x in (tables, positions, seq_lens)))
    return k_pool.numpy(), v_pool.numpy()


SEQS = [(0, 1), (13, 1), (0, 9), (19, 5), (40, 2)]  # decodes, a prefill, chunks after a cached prefix


@pytest.mark.parametrize(("kv_width", "block_size"), [(48, 16), (64, 8), (128, 32)])
def test_kv_write_matches_reference_and_skips_padding(kv_width, block_size):
    case = padded_case(np.random.default_rng(0), SEQS, kv_width, block_size)
    got, want = run_write(*case), write_reference(*case)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert not np.array_equal(want[0], case[2][0])  # something was written


def test_kv_write_catches_a_wrong_seq_len():
    k, v, pools, tables, positions, seq_lens = padded_case(np.random.default_rng(1), SEQS, 48, 16)
    want = write_reference(k, v, pools, tables, positions, seq_lens)
    broken = seq_lens.copy()
    broken[0] = 3  # padding rows of sequence 0 would overwrite its real row's slot
    assert not np.array_equal(run_write(k, v, pools, tables, positions, broken)[0], want[0])


def plugin_attention(q, pools, tables, positions, shape, window=0):
    tensors = (torch.from_numpy(x) for x in (q, *pools, tables, positions))
    return paged_attention_padded(*tensors, shape.num_kv_heads, shape.head_dim**-0.5, window, sm_count=132).numpy()


def splits_of(shape, positions, tables) -> int:
    tiles = AttentionTiles(shape.num_heads // shape.num_kv_heads, shape.head_dim, 4)
    return num_splits(len(tables), positions.shape[1], tables.shape[1], shape.block_size, shape.num_kv_heads,
                      tiles, 132)  # fmt: skip


LONG_DECODES = [(700, 1), (13, 1), (1030, 1)]  # a decode step long enough to split


@pytest.mark.parametrize(
    ("shape", "window", "seqs"),
    [
        (AttentionShape(9, 3, 64, 16), 0, SEQS),  # prefill tiles (step 9 > 5 decode rows)
        (AttentionShape(8, 2, 16, 32), 0, SEQS),
        (AttentionShape(4, 4, 32, 16), 7, SEQS),
        (AttentionShape(8, 2, 32, 16), 0, LONG_DECODES),  # decode path, 5 KV splits + merge
        (AttentionShape(8, 2, 32, 16), 100, [(700, 2), (13, 1), (1030, 3)]),  # speculative verify, split
    ],
)
def test_write_then_plugin_attention_matches_reference(shape, window, seqs):
    rng = np.random.default_rng(2)
    kv_width = shape.num_kv_heads * shape.head_dim
    k, v, pools, tables, positions, seq_lens = padded_case(rng, seqs, kv_width, shape.block_size, num_blocks=200)
    k_pool, v_pool = run_write(k, v, pools, tables, positions, seq_lens)
    q = rng.standard_normal((*positions.shape, shape.num_heads * shape.head_dim), dtype=np.float32)
    got = plugin_attention(q, (k_pool, v_pool), tables, positions, shape, window)
    real = [(b, i) for b in range(len(seqs)) for i in range(seq_lens[b])]
    flat_q = np.stack([q[b, i] for b, i in real])
    seq_of_token = np.array([b for b, _ in real])
    flat_pos = np.array([positions[b, i] for b, i in real])
    want = reference(flat_q, k_pool, v_pool, tables, seq_of_token, flat_pos, shape, window=window or None)
    np.testing.assert_allclose(np.stack([got[b, i] for b, i in real]), want, atol=2e-5)
    padding = [got[b, i] for b in range(len(seqs)) for i in range(seq_lens[b], positions.shape[1])]
    assert not np.any(padding)  # no attention for padding rows: zeros
    assert (splits_of(shape, positions, tables) > 1) == (seqs is not SEQS)
    # the check can fail: attention over the pool before this step's rows were written differs
    stale = reference(flat_q, *pools, tables, seq_of_token, flat_pos, shape, window=window or None)
    assert np.abs(stale - want).max() > 1e-2


def reference_graph() -> onnx.ModelProto:
    """KV write -> attention -> merge as the plugin graph wires them, with the ONNX reference bodies."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    shape = LONG_SHAPE
    nodes = [
        helper.make_node(KV_WRITE, ["k", "v", "key_cache", "value_cache", "block_tables", "positions", "seq_lens"],
                         ["kw", "vw"], domain=DOMAIN, block_size=shape.block_size),
        helper.make_node(ATTENTION, ["q", "kw", "vw", "block_tables", "positions"], ["unmerged", "partials"],
                         domain=DOMAIN, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, window=0,
                         scale=shape.head_dim**-0.5, cached_shape=[0, -1, shape.num_kv_heads * shape.head_dim]),
        helper.make_node(MERGE, ["unmerged", "partials", "block_tables", "positions"], ["ctx"], domain=DOMAIN,
                         num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         block_size=shape.block_size),
    ]  # fmt: skip
    names = [("q", f), ("k", f), ("v", f), ("key_cache", f), ("value_cache", f), ("block_tables", i64),
             ("positions", i64), ("seq_lens", i64)]  # fmt: skip
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, t, None) for n, t in names],
                              [helper.make_tensor_value_info("ctx", f, None)])  # fmt: skip
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, functions=reference_functions())


LONG_SHAPE = AttentionShape(8, 2, 32, 16)


def test_onnx_reference_functions_agree_with_the_kernels():
    """The plugin graph's ONNX bodies (ONNX Runtime) and the kernels (a split launch) give the
    same real rows: the attention/merge pair stays equivalent to the single op it replaced."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(5)
    seqs = [(700, 2), (13, 1), (1030, 2)]
    k, v, pools, tables, positions, seq_lens = padded_case(rng, seqs, 64, LONG_SHAPE.block_size, num_blocks=200)
    q = rng.standard_normal((*positions.shape, 256), dtype=np.float32)
    session = ort.InferenceSession(reference_graph().SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = dict(q=q, k=k, v=v, key_cache=pools[0], value_cache=pools[1], block_tables=tables, positions=positions,
                 seq_lens=seq_lens)  # fmt: skip
    (want,) = session.run(None, feeds)
    assert splits_of(LONG_SHAPE, positions, tables) > 1
    got = plugin_attention(q, run_write(k, v, pools, tables, positions, seq_lens), tables, positions, LONG_SHAPE)
    real = [(b, i) for b in range(len(seqs)) for i in range(seq_lens[b])]
    np.testing.assert_allclose(np.stack([got[r] for r in real]), np.stack([want[r] for r in real]), atol=2e-5)
    stale = plugin_attention(q, pools, tables, positions, LONG_SHAPE)  # the check can fail: an unwritten pool
    assert np.abs(np.stack([stale[r] for r in real]) - np.stack([want[r] for r in real])).max() > 1e-2

"""The plugin-layout Triton kernels (padded [batch, step], as the TensorRT plugin nodes see
them) on CPU under Triton's interpreter: PagedKVWrite against a per-row numpy loop, and
KV write + padded PagedAttention against the numpy attention reference; plus their AOT
compilation for sm_80/89/90 (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from plugins_cuda.kv_write import paged_kv_write  # noqa: E402
from plugins_cuda.paged_attention import paged_attention_padded  # noqa: E402
from runtime.backends.cpu_attention import AttentionShape  # noqa: E402
from tests.test_paged_attention import reference  # noqa: E402


def padded_case(rng, seqs: list[tuple[int, int]], kv_width: int, block_size: int, num_blocks: int = 48):
    """(past_len, new_tokens) per sequence -> padded step inputs, block tables covering the step."""
    batch, step = len(seqs), max(n for _, n in seqs)
    need = [-(-(past + n) // block_size) for past, n in seqs]
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


@pytest.mark.parametrize(
    ("shape", "window"),
    [(AttentionShape(9, 3, 64, 16), 0), (AttentionShape(8, 2, 16, 32), 0), (AttentionShape(4, 4, 32, 16), 7)],
)
def test_write_then_padded_attention_matches_reference(shape, window):
    rng = np.random.default_rng(2)
    kv_width = shape.num_kv_heads * shape.head_dim
    k, v, pools, tables, positions, seq_lens = padded_case(rng, SEQS, kv_width, shape.block_size)
    k_pool, v_pool = run_write(k, v, pools, tables, positions, seq_lens)
    q = rng.standard_normal((*positions.shape, shape.num_heads * shape.head_dim), dtype=np.float32)
    got = paged_attention_padded(
        torch.from_numpy(q), torch.from_numpy(k_pool), torch.from_numpy(v_pool), torch.from_numpy(tables),
        torch.from_numpy(positions), shape.num_kv_heads, shape.head_dim**-0.5, window,
    ).numpy()  # fmt: skip
    real = [(b, i) for b in range(len(SEQS)) for i in range(seq_lens[b])]
    flat_q = np.stack([q[b, i] for b, i in real])
    seq_of_token = np.array([b for b, _ in real])
    flat_pos = np.array([positions[b, i] for b, i in real])
    want = reference(flat_q, k_pool, v_pool, tables, seq_of_token, flat_pos, shape, window=window or None)
    np.testing.assert_allclose(np.stack([got[b, i] for b, i in real]), want, atol=2e-5)
    # the check can fail: attention over the pool before this step's rows were written differs
    stale = reference(flat_q, *pools, tables, seq_of_token, flat_pos, shape, window=window or None)
    assert np.abs(stale - want).max() > 1e-2


def test_aot_compiles_plugin_entries_for_sm80_sm89_sm90():
    """Fresh process (no interpreter): PTX/cubin per arch, no scratch, and the PTX entry takes
    exactly the plugin's arguments plus Triton's two hidden scratch pointers."""
    script = (
        "import json\n"
        "from plugins_cuda import kv_write, paged_attention\n"
        "out = {}\n"
        "for arch in (80, 89, 90):\n"
        "    for name, k in (('kv_write', kv_write.compile_for_arch(arch, 'float16', 192, 64)),\n"
        "                    ('attention', paged_attention.compile_padded_for_arch(arch, 'bfloat16', 3, 3, 64, 64,\n"
        "                                                                        0.125, 0))):\n"
        "        m, ptx = k.metadata, k.asm['ptx']\n"
        "        entry = ptx[ptx.index('.entry'):]\n"
        "        out[f'{name}.{arch}'] = dict(cubin=len(k.asm['cubin']), shared=m.shared, name=m.name,\n"
        "            scratch=m.global_scratch_size + m.profile_scratch_size, target=f'.target sm_{arch}' in ptx,\n"
        "            params=entry[:entry.index(')')].count('.param'))\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    for key, info in compiled.items():
        assert info["target"] and info["cubin"] > 1000 and info["scratch"] == 0, key
        # kv_write: 7 inputs + 2 int32 + 2 outputs; attention: 5 inputs + 2 int32 + 1 output; + 2 hidden
        assert info["params"] == (11 if key.startswith("kv_write") else 8) + 2, key

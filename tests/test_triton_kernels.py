"""The Triton-language paged-attention kernel (plugins_cuda) on CPU: run by Triton's
interpreter against the numpy reference, and AOT-compiled for sm_80/89/90 (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (jit reads it)

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from plugins_cuda.paged_attention import paged_attention  # noqa: E402
from runtime.paged_attention import AttentionShape  # noqa: E402
from tests.test_paged_attention import make_case, reference  # noqa: E402

CASES = [
    # (shape, [(past_len, new_tokens), ...]) - decodes, prefill chunks, context length 1,
    # lengths that are not multiples of the block size
    (AttentionShape(9, 3, 64, 16), [(0, 1), (5, 1), (37, 1), (0, 9), (19, 5)]),  # SmolLM2 heads
    (AttentionShape(4, 4, 16, 32), [(0, 1), (40, 1), (3, 6)]),  # MHA
    (AttentionShape(32, 2, 32, 16), [(0, 1), (21, 1), (30, 3)]),  # GQA ratio 16
    (AttentionShape(8, 1, 32, 128), [(0, 1), (130, 1), (100, 4)]),  # MQA, block size 128
]


def run(q, k, v, tables, seqs, pos, shape, window=0, dtype=torch.float32):
    tensors = [torch.from_numpy(x) for x in (q, k, v)]
    tensors = [t.to(dtype) for t in tensors]
    out = paged_attention(*tensors, *(torch.from_numpy(x) for x in (tables, seqs, pos)),
                          num_kv_heads=shape.num_kv_heads, window=window)  # fmt: skip
    return out.float().numpy()


@pytest.mark.parametrize(("shape", "seqs"), CASES, ids=lambda c: str(c) if not isinstance(c, list) else "")
def test_interpreted_kernel_matches_reference(shape, seqs):
    args = make_case(np.random.default_rng(0), shape, seqs)
    np.testing.assert_allclose(run(*args, shape), reference(*args, shape), atol=2e-5)


def test_sliding_window_and_float16():
    shape = AttentionShape(9, 3, 64, 16)
    args = make_case(np.random.default_rng(1), shape, [(0, 1), (37, 1), (10, 8)])
    np.testing.assert_allclose(run(*args, shape, window=7), reference(*args, shape, window=7), atol=2e-5)
    np.testing.assert_allclose(run(*args, shape, dtype=torch.float16), reference(*args, shape), atol=2e-2)


def test_a_wrong_block_table_is_caught():
    shape = AttentionShape(4, 4, 16, 32)
    q, k, v, tables, seqs, pos = make_case(np.random.default_rng(2), shape, [(40, 1)])
    want = reference(q, k, v, tables, seqs, pos, shape)
    broken = tables.copy()
    broken[0, 0] = (broken[0, 0] + 1) % k.shape[0]
    assert np.abs(run(q, k, v, broken, seqs, pos, shape) - want).max() > 1e-2


SM_SHARED_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # max dynamic shared memory per block


def test_aot_compiles_for_sm80_sm89_sm90():
    """Compiled in a fresh process: the interpreter mode set above must not leak into it."""
    script = (
        "import json; from plugins_cuda.paged_attention import compile_for_arch\n"
        "out = {}\n"
        "for arch in (80, 89, 90):\n"
        "    k = compile_for_arch(arch, 'float16', 3, 3, 64, 64)\n"
        "    m = k.metadata\n"
        "    out[arch] = dict(ptx=len(k.asm['ptx']), cubin=len(k.asm['cubin']), shared=m.shared,\n"
        "                     scratch=m.global_scratch_size + m.profile_scratch_size, target=k.asm['ptx'][:2000])\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    for arch, info in compiled.items():
        assert info["ptx"] > 1000 and info["cubin"] > 1000
        assert info["scratch"] == 0
        assert 0 < info["shared"] <= SM_SHARED_LIMIT[int(arch)]
        assert f".target sm_{arch}" in info["target"]


def test_trtserve_kernels_cli_writes_ptx_cubin_and_metadata(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    trtserve = os.path.join(os.path.dirname(sys.executable), "trtserve")
    result = subprocess.run([trtserve, "kernels", "--arch", "sm_80", "--arch", "sm_90", "--out", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for arch in ("sm_80", "sm_90"):
        assert (tmp_path / f"paged_attention.{arch}.ptx").read_text().count(f".target {arch}") == 1
        assert (tmp_path / f"paged_attention.{arch}.cubin").stat().st_size > 1000
        info = json.loads((tmp_path / f"paged_attention.{arch}.json").read_text())
        assert info["global_scratch_bytes"] == 0 and info["shared_memory_bytes"] > 0

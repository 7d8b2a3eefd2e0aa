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
from runtime.backends.cpu_attention import AttentionShape  # noqa: E402
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


def test_aot_compiles_both_kernels_for_sm80_sm89_sm90():
    """Compiled in a fresh process: the interpreter mode set above must not leak into it."""
    script = (
        "import json\n"
        "from plugins_cuda import fused_qkv, paged_attention\n"
        "out = {}\n"
        "for arch in (80, 89, 90):\n"
        "    for name, k in (('attention', paged_attention.compile_for_arch(arch, 'float16', 3, 3, 64, 64)),\n"
        "                    ('prologue', fused_qkv.compile_for_arch(arch, 'bfloat16', 576, 9, 3, 64, True))):\n"
        "        m = k.metadata\n"
        "        out[f'{name}.{arch}'] = dict(ptx=len(k.asm['ptx']), cubin=len(k.asm['cubin']), shared=m.shared,\n"
        "            scratch=m.global_scratch_size + m.profile_scratch_size, target=k.asm['ptx'][:2000])\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(compiled) == 6
    for key, info in compiled.items():
        arch = key.split(".")[1]
        assert info["ptx"] > 1000 and info["cubin"] > 1000
        assert info["scratch"] == 0
        assert 0 < info["shared"] <= SM_SHARED_LIMIT[int(arch)]
        assert f".target sm_{arch}" in info["target"]


# ---- fused RMSNorm -> QKV -> RoPE ----------------------------------------------------------------

from plugins_cuda.fused_qkv import fused_rmsnorm_qkv_rope  # noqa: E402


def prologue_reference(x, norm, w, bias, cos, sin, positions, num_q, num_kv, eps):
    """Written from the HF Llama definitions: RMSNorm, a linear layer, rotate-half RoPE."""
    tokens, heads = x.shape[0], num_q + 2 * num_kv
    xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * norm.double()
    y = xn @ w.double() + (bias.double() if bias is not None else 0.0)
    y = y.view(tokens, heads, -1)
    half = y.shape[-1] // 2
    c = torch.cat([cos[positions], cos[positions]], -1).double()[:, None]
    s = torch.cat([sin[positions], sin[positions]], -1).double()[:, None]
    rotated = torch.cat([-y[..., half:], y[..., :half]], -1)
    qk = y[:, : num_q + num_kv] * c + rotated[:, : num_q + num_kv] * s
    return torch.cat([qk, y[:, num_q + num_kv :]], 1).reshape(tokens, -1)


def prologue_case(tokens, hidden, num_q, num_kv, head_dim, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = (num_q + 2 * num_kv) * head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(512).float()[:, None] * inv_freq[None]
    return dict(
        x=torch.randn(tokens, hidden, generator=gen), norm=torch.rand(hidden, generator=gen) + 0.5,
        w=torch.randn(hidden, width, generator=gen) / hidden**0.5,
        bias=torch.randn(width, generator=gen) * 0.1 if bias else None,
        cos=freqs.cos(), sin=freqs.sin(), positions=torch.randint(0, 512, (tokens,), generator=gen),
        num_q=num_q, num_kv=num_kv, eps=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "hidden", "num_q", "num_kv", "head_dim", "bias"),
    [
        (1, 64, 4, 2, 32, False),  # one token
        (21, 96, 4, 1, 32, True),  # tokens not a multiple of the tile, hidden not of BLOCK_K, bias (Qwen2)
        (18, 576, 9, 3, 64, False),  # SmolLM2-135M
        (5, 128, 2, 2, 128, False),  # head_dim 128
    ],
)
def test_fused_prologue_matches_reference(tokens, hidden, num_q, num_kv, head_dim, bias):
    case = prologue_case(tokens, hidden, num_q, num_kv, head_dim, bias)
    got = fused_rmsnorm_qkv_rope(case["x"], case["norm"], case["w"], case["bias"], case["cos"], case["sin"],
                                 case["positions"], num_q, num_kv, case["eps"])  # fmt: skip
    torch.testing.assert_close(got.double(), prologue_reference(**case), atol=2e-5, rtol=1e-4)


def test_fused_prologue_float16_and_a_caught_fault():
    case = prologue_case(16, 64, 4, 2, 32, True, seed=3)
    want = prologue_reference(**case)
    half = {k: (v.half() if k in ("x", "norm", "w", "bias") else v) for k, v in case.items()}
    got = fused_rmsnorm_qkv_rope(half["x"], half["norm"], half["w"], half["bias"], case["cos"], case["sin"],
                                 case["positions"], 4, 2, case["eps"])  # fmt: skip
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    shifted = case["positions"] + 1  # RoPE at the wrong positions must be caught
    wrong = fused_rmsnorm_qkv_rope(case["x"], case["norm"], case["w"], case["bias"], case["cos"], case["sin"],
                                   shifted, 4, 2, case["eps"])  # fmt: skip
    assert (wrong.double() - want).abs().max() > 1e-2

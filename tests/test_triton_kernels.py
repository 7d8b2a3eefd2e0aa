"""The Triton-language kernels (plugins_cuda) on CPU: paged attention over the flat ragged
layout and the fused prologue run by Triton's interpreter against numpy/float64 references,
the 64-bit offset helpers with strides past 2^31, the split-KV heuristic, and the AOT
compilation for sm_80/89/90 of Llama-3-8B-sized kernels (no GPU needed)."""

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
from plugins_cuda.interpreter import interpreter_problem  # noqa: E402

if interpreter_problem():
    pytest.skip(interpreter_problem(), allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from executors.cpu_attention import AttentionShape  # noqa: E402
from plugins_cuda.attention_launch import AttentionTiles, num_splits, paged_attention  # noqa: E402
from plugins_cuda.common import row_offsets, slot_offsets  # noqa: E402
from plugins_cuda.fused_qkv import fused_rmsnorm_qkv_rope  # noqa: E402
from tests.test_paged_attention import make_case, reference  # noqa: E402

SMS = 132
CASES = [
    # (shape, [(past_len, new_tokens), ...]): decodes, prefill chunks, context length 1, lengths
    # that are not multiples of the block size or of the key tile (64)
    (AttentionShape(9, 3, 64, 16), [(0, 1), (5, 1), (37, 1), (0, 9), (19, 5)]),  # SmolLM2 heads, decode path
    (AttentionShape(4, 4, 16, 32), [(0, 1), (40, 1), (3, 6)]),  # MHA: 6 rows still take the decode path
    (AttentionShape(32, 2, 32, 16), [(0, 1), (21, 1), (30, 3)]),  # GQA ratio 16: 3 rows take prefill tiles
    (AttentionShape(8, 1, 32, 24), [(0, 1), (130, 1), (100, 4)]),  # MQA, block size 24 (not a power of two)
    (AttentionShape(6, 2, 32, 8), [(0, 70), (11, 45)]),  # prefill: 10-token tiles straddling 8-slot blocks
]
LONG = (AttentionShape(4, 2, 32, 16), [(700, 1), (1100, 1), (9, 1)])  # decodes long enough to split


def run(q, k, v, tables, seqs, pos, shape, window=0, dtype=torch.float32):
    tensors = [torch.from_numpy(x).to(dtype) for x in (q, k, v)]
    out = paged_attention(*tensors, *(torch.from_numpy(x) for x in (tables, seqs, pos)),
                          num_kv_heads=shape.num_kv_heads, window=window, sm_count=SMS)  # fmt: skip
    return out.float().numpy()


def splits_of(shape: AttentionShape, seqs, tables) -> int:
    tiles = AttentionTiles(shape.num_heads // shape.num_kv_heads, shape.head_dim, 4)
    step = max(n for _, n in seqs)
    return num_splits(len(seqs), step, tables.shape[1], shape.block_size, shape.num_kv_heads, tiles, SMS)


@pytest.mark.parametrize(("shape", "seqs"), [*CASES, LONG], ids=lambda c: str(c) if not isinstance(c, list) else "")
def test_interpreted_kernel_matches_reference(shape, seqs):
    args = make_case(np.random.default_rng(0), shape, seqs, num_blocks=256)
    np.testing.assert_allclose(run(*args, shape), reference(*args, shape), atol=2e-5)


def test_long_decodes_split_and_merge():
    """LONG runs split (the merge kernel combines 5 parts); a window inside a split still matches."""
    shape, seqs = LONG
    args = make_case(np.random.default_rng(4), shape, seqs, num_blocks=256)
    assert splits_of(shape, seqs, args[3]) == 5  # ceil(69 blocks * 16 keys / 256)
    np.testing.assert_allclose(run(*args, shape, window=300), reference(*args, shape, window=300), atol=2e-5)


def test_split_count_heuristic():
    tiles = AttentionTiles(4, 128)  # Llama-3-8B: 8 kv heads, decode path up to 4 rows per sequence
    assert num_splits(1, 1, 512, 64, 8, tiles, SMS) == 64  # one 32k-token sequence: the cap
    assert num_splits(1, 1, 8, 64, 8, tiles, SMS) == 2  # 512 tokens: 256 keys per part
    assert num_splits(16, 1, 512, 64, 8, tiles, SMS) == 4  # 528 programs // (16 x 8 lanes)
    assert num_splits(64, 1, 512, 64, 8, tiles, SMS) == 1  # the batch fills the GPU
    assert num_splits(1, 4, 512, 64, 8, tiles, SMS) == 64  # a speculative verify of 3 drafts splits
    assert num_splits(1, 5, 512, 64, 8, tiles, SMS) == 1  # 5 rows: prefill tiles, no split


def test_sliding_window_and_float16():
    shape = AttentionShape(9, 3, 64, 16)
    args = make_case(np.random.default_rng(1), shape, [(0, 1), (37, 1), (10, 8), (3, 70)], num_blocks=128)
    np.testing.assert_allclose(run(*args, shape, window=7), reference(*args, shape, window=7), atol=2e-5)
    np.testing.assert_allclose(run(*args, shape, dtype=torch.float16), reference(*args, shape), atol=2e-2)


def test_a_wrong_block_table_is_caught():
    shape, seqs = LONG  # a split launch: the fault lands in one part of the merge
    q, k, v, tables, seq_of_token, pos = make_case(np.random.default_rng(2), shape, seqs, num_blocks=256)
    want = reference(q, k, v, tables, seq_of_token, pos, shape)
    broken = tables.copy()
    broken[1, 30] = (broken[1, 30] + 1) % k.shape[0]
    assert np.abs(run(q, k, v, broken, seq_of_token, pos, shape) - want).max() > 1e-2


def test_tokens_out_of_sequence_order_are_refused():
    shape = AttentionShape(4, 4, 16, 32)
    q, k, v, tables, seq_of_token, pos = make_case(np.random.default_rng(3), shape, [(0, 2), (5, 1)])
    with pytest.raises(ValueError, match="contiguous rows"):
        run(q, k, v, tables, seq_of_token[::-1].copy(), pos, shape)


# ---- 64-bit offsets --------------------------------------------------------------------------


@triton.jit
def _offsets_probe(rows_ptr, blocks_ptr, out_ptr, width, BLOCK_SIZE: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    rows = tl.load(rows_ptr + i)
    tl.store(out_ptr + i, row_offsets(rows, width))
    tl.store(out_ptr + N + i, slot_offsets(tl.load(blocks_ptr + i), i % BLOCK_SIZE, BLOCK_SIZE, width))
    tl.store(out_ptr + 2 * N + i, (rows * width).to(tl.int64))  # the int32 product the helpers avoid


def test_offset_helpers_do_not_wrap_past_2_pow_31():
    """Strides only, no memory: 2^20 rows of a 4096-wide q, and pool block 40,000 of 64 slots,
    both beyond 2^31 elements; the plain int32 product of the same operands wraps."""
    rows = torch.tensor([0, 1, 1 << 19, (1 << 20) + 3], dtype=torch.int32)
    blocks = torch.tensor([0, 7, 40_000, 65_535], dtype=torch.int32)
    out = torch.zeros(12, dtype=torch.int64)
    _offsets_probe[(1,)](rows, blocks, out, 4096, BLOCK_SIZE=64, N=4)
    assert out[:4].tolist() == [r * 4096 for r in rows.tolist()]
    assert out[4:8].tolist() == [(b * 64 + i % 64) * 4096 for i, b in enumerate(blocks.tolist())]
    assert out[8:].tolist() != out[:4].tolist()  # the check can fail: int32 wraps at row 2^20


# ---- fused RMSNorm -> QKV -> RoPE ----------------------------------------------------------------


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


def prologue(case, tactic, **override):
    a = {**case, **override}
    out = fused_rmsnorm_qkv_rope(a["x"], a["norm"], a["w"], a["bias"], a["cos"], a["sin"], a["positions"],
                                 a["num_q"], a["num_kv"], a["eps"], tactic=tactic)  # fmt: skip
    return torch.cat(out, 1).double()


@pytest.mark.parametrize("tactic", ["decode", "prefill", "gemm"])
@pytest.mark.parametrize(
    ("tokens", "hidden", "num_q", "num_kv", "head_dim", "bias"),
    [
        (1, 64, 4, 2, 32, False),  # one token
        (21, 96, 4, 1, 32, True),  # tokens not a multiple of the tile, hidden not of BLOCK_K, bias (Qwen2)
        (18, 576, 9, 3, 64, False),  # SmolLM2-135M: column tiles straddle q, k and v heads
        (70, 128, 2, 2, 128, False),  # head_dim 128, two token tiles of the prefill tactic
    ],
)
def test_fused_prologue_matches_reference(tokens, hidden, num_q, num_kv, head_dim, bias, tactic):
    case = prologue_case(tokens, hidden, num_q, num_kv, head_dim, bias)
    torch.testing.assert_close(prologue(case, tactic), prologue_reference(**case), atol=2e-5, rtol=1e-4)


def test_fused_prologue_float16_and_a_caught_fault():
    case = prologue_case(16, 64, 4, 2, 32, True, seed=3)
    want = prologue_reference(**case)
    half = {k: (v.half() if k in ("x", "norm", "w", "bias") else v) for k, v in case.items()}
    torch.testing.assert_close(prologue(half, "decode"), want, atol=2e-2, rtol=2e-2)
    shifted = case["positions"] + 1  # RoPE at the wrong positions must be caught
    assert (prologue(case, "decode", positions=shifted) - want).abs().max() > 1e-2
    torch.testing.assert_close(prologue(half, "gemm"), want, atol=2e-2, rtol=2e-2)
    assert (prologue(case, "gemm", positions=shifted) - want).abs().max() > 1e-2
    no_norm = {**case, "norm": torch.ones_like(case["norm"])}  # the GEMM path must apply the norm weight
    assert (prologue(no_norm, "gemm") - want).abs().max() > 1e-2


def test_prologue_default_tactic_is_the_gemm_path(monkeypatch):
    """The torch launcher's default is the GEMM tactic at every token count (fastest on an H100), and its
    output is the reference's."""
    from plugins_cuda import fused_qkv, prologue_gemm

    assert {fused_qkv.default_tactic(n) for n in (1, 64, 65, 2048)} == {"gemm"}
    calls = []
    real = prologue_gemm.rmsnorm_gemm_rope
    monkeypatch.setattr(prologue_gemm, "rmsnorm_gemm_rope", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for tokens in (1, 65):
        case = prologue_case(tokens, 64, 2, 1, 32, False)
        torch.testing.assert_close(prologue(case, None), prologue_reference(**case), atol=2e-5, rtol=1e-4)
    assert calls == [1, 65]


# ---- AOT compilation -----------------------------------------------------------------------------

SM_SHARED_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # max dynamic shared memory per block
AOT_SCRIPT = """
import json
from plugins_cuda import attention_launch, fused_qkv
out = {}
for arch in (80, 89, 90):
    kernels = {
        'attention.bf16': attention_launch.compile_attention(arch, 'bfloat16', 8, 4, 128, 16, 128 ** -0.5),
        'attention.fp32.window': attention_launch.compile_attention(arch, 'float32', 8, 4, 128, 64, 0.1, 4096),
        'attention.mqa.fp16': attention_launch.compile_attention(arch, 'float16', 1, 32, 128, 64, 0.1),
        'merge.bf16': attention_launch.compile_merge(arch, 'bfloat16', 8, 4, 128),
    }
    for dtype in ('bfloat16', 'float32'):
        for tactic in fused_qkv.TACTICS:
            kernels[f'prologue.{dtype}.{tactic}'] = fused_qkv.compile_for_arch(
                arch, dtype, 4096, 32, 8, 128, True, tactic=tactic)
    for name, k in kernels.items():
        m = k.metadata
        out[f'{name}.{arch}'] = dict(ptx=len(k.asm['ptx']), cubin=len(k.asm['cubin']), shared=m.shared,
            scratch=m.global_scratch_size + m.profile_scratch_size, target=k.asm['ptx'][:2000])
print(json.dumps(out))
"""


def test_aot_compiles_llama3_8b_kernels_for_sm80_sm89_sm90():
    """Compiled in a fresh process (the interpreter mode set above must not leak into it):
    every kernel for every arch within the arch's shared memory, and no global scratch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(compiled) == 3 * 8
    for key, info in compiled.items():
        arch = int(key.rsplit(".", 1)[1])
        assert info["ptx"] > 1000 and info["cubin"] > 1000, key
        assert info["scratch"] == 0, key
        assert info["shared"] <= SM_SHARED_LIMIT[arch], key
        assert f".target sm_{arch}" in info["target"], key

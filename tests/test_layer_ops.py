"""The cpu-bf16 backend's C glue (executors/layer_ops.py) against torch and float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executors import layer_ops
from tests.helpers import hf_rms_norm as torch_rms_norm

BF16_ULP = 2.0**-7  # bfloat16's relative spacing: one rounding apart at most


@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 64), (300, 576)])  # 300 x 576: the OpenMP path
def test_rms_norm_matches_hf_bfloat16(rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    got, ref = layer_ops.rms_norm(x, weight, 1e-5).float(), torch_rms_norm(x, weight, 1e-5).float()
    assert (got == ref).float().mean() > 0.99  # the same roundings, bar a sum's last bit
    torch.testing.assert_close(got, ref, rtol=BF16_ULP, atol=1e-6)


def test_rms_norm_check_catches_a_wrong_weight():
    x = torch.randn(4, 64).bfloat16()
    weight = torch.ones(64).bfloat16()
    wrong = weight.clone()
    wrong[3] = 2
    with pytest.raises(AssertionError):
        torch.testing.assert_close(layer_ops.rms_norm(x, wrong, 1e-5).float(), torch_rms_norm(x, weight, 1e-5).float(),
                                   rtol=BF16_ULP, atol=1e-6)  # fmt: skip


def rope_reference(qkv: np.ndarray, heads: int, kv_heads: int, base: float, positions: np.ndarray):
    """Rotate-half RoPE in float64 over q and k heads; v passed through."""
    tokens, head_dim = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
    x = qkv.astype(np.float64).reshape(tokens, heads + 2 * kv_heads, head_dim)
    half = head_dim // 2
    angle = positions[:, None, None] * base ** (-np.arange(half) / half)  # [T, 1, half]
    x1, x2 = x[:, : heads + kv_heads, :half], x[:, : heads + kv_heads, half:]
    rotated = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)
    q, k = rotated[:, :heads].reshape(tokens, -1), rotated[:, heads:].reshape(tokens, -1)
    return q, k, x[:, heads + kv_heads :].reshape(tokens, -1)


def tables(base: float, head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    half = head_dim // 2
    inverse_frequencies = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * inverse_frequencies
    cos, sin = angle.cos().float(), angle.sin().float()
    return torch.cat([cos, cos], -1).contiguous(), torch.cat([-sin, sin], -1).contiguous()


@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_rope_split_matches_float64(tokens):
    heads, kv_heads, head_dim, base = 9, 3, 64, 10000.0
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(tokens))
    qkv = qkv.bfloat16()
    positions = np.random.default_rng(tokens).integers(0, 1000, tokens)
    cos, sin = tables(base, head_dim, 1024)
    q, k, v = layer_ops.rope_split(qkv, heads, kv_heads, cos, sin, positions)
    ref_q, ref_k, ref_v = rope_reference(qkv.float().numpy(), heads, kv_heads, base, positions)
    np.testing.assert_allclose(q, ref_q, atol=1e-5)  # float32 tables and products
    np.testing.assert_allclose(k, ref_k, atol=1e-5)
    np.testing.assert_array_equal(v, ref_v)  # bfloat16 -> float32 is exact
    wrong = rope_reference(qkv.float().numpy(), heads, kv_heads, base, positions + 1)[0]
    assert np.abs(q - wrong).max() > 0.1  # a position off by one is caught


def test_bad_inputs_are_refused():
    cos, sin = tables(10000.0, 64, 16)
    qkv = torch.zeros(2, 15 * 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="positions"):
        layer_ops.rope_split(qkv, 9, 3, cos, sin, np.array([0, 16]))  # past the tables
    with pytest.raises(ValueError, match="heads"):
        layer_ops.rope_split(qkv, 8, 3, cos, sin, np.array([0, 1]))
    with pytest.raises(ValueError, match="contiguous"):
        layer_ops.rope_split(qkv.float(), 9, 3, cos, sin, np.array([0, 1]))
    with pytest.raises(ValueError, match="weight"):
        layer_ops.rms_norm(qkv, torch.ones(3, dtype=torch.bfloat16), 1e-5)

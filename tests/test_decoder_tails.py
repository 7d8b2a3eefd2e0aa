"""The decoder's fused tails (plugins_cuda/decoder_tails.py) under Triton's interpreter: residual add +
RMSNorm and SiLU(gate) * up against a float64 reference (plugins_cuda.check, as on a GPU), the same
roundings as the torch ops they replace (HF eager's), and a fault the reference catches."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (jit reads it)

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from plugins_cuda.interpreter import interpreter_problem  # noqa: E402

if interpreter_problem():
    pytest.skip(interpreter_problem(), allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from plugins_cuda.check import TAIL_CASES, TOLERANCE, tails_errors, tails_reference  # noqa: E402
from plugins_cuda.decoder_tails import add_rms_norm, silu_mul  # noqa: E402
from tests.helpers import hf_rms_norm  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("shape", [*TAIL_CASES["interpret"], (5, 4096, 64)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tails_match_float64(shape, dtype):
    """Row counts under and over a program's tile, widths that are not powers of two, a 4096-wide row."""
    errors = tails_errors(*shape, DTYPES[dtype], "cpu")
    assert max(errors.values()) <= TOLERANCE[dtype], errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tails_round_as_the_torch_ops_they_replace(dtype):
    """Within a few ulps of the decoder's torch sequence (the mean's summation order differs; bfloat16 is left
    out: the interpreter truncates where a GPU rounds to nearest)."""
    gen = torch.Generator().manual_seed(3)
    hidden, delta = (torch.randn(19, 576, generator=gen).to(dtype) for _ in range(2))
    norm, gate_up = (torch.rand(576, generator=gen) + 0.5).to(dtype), torch.randn(19, 3072, generator=gen).to(dtype)
    total, normed = add_rms_norm(hidden, delta, norm, 1e-6)
    assert torch.equal(total, hidden + delta)
    ulp = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(normed, hf_rms_norm(hidden + delta, norm, 1e-6), rtol=ulp, atol=ulp)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, rtol=ulp, atol=ulp)


def test_the_reference_catches_swapped_gate_and_up():
    gen = torch.Generator().manual_seed(4)
    hidden, delta, norm = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen), torch.ones(64)
    gate_up = torch.randn(3, 128, generator=gen)
    swapped = torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1)
    *_, want = tails_reference(hidden, delta, norm, gate_up, 1e-5)
    error = float((silu_mul(swapped).double() - want).abs().max() / want.abs().max())
    assert error > 10 * TOLERANCE["float32"]


def test_without_a_delta_only_the_norm_is_computed():
    """The first layer's input norm: nothing to add, the residual stream passed through untouched."""
    gen = torch.Generator().manual_seed(5)
    hidden, norm = torch.randn(9, 96, generator=gen), torch.rand(96, generator=gen) + 0.5
    total, normed = add_rms_norm(hidden, None, norm, 1e-5)
    assert total is hidden
    _, want, _ = tails_reference(hidden, torch.zeros_like(hidden), norm, torch.zeros(9, 2), 1e-5)
    torch.testing.assert_close(normed.double(), want, rtol=1e-5, atol=1e-6)

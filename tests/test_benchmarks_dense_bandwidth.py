"""The dense-bandwidth benchmark (benchmarks/dense_bandwidth.py): every weight format it times computes
the layer's matmul (so its timings compare the same work), and its chain and report run on the tiny engine."""

from __future__ import annotations

import pytest
import torch

from benchmarks import dense_bandwidth
from engine_format import EngineConfig
from tests.helpers import NEEDS_BF16_MATMUL

ROWS = 4


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


# bf16 rounds inputs and weights; int8 a step of max/127 per channel; int4 one of 16 levels per group of 32.
TOLERANCE = {"bf16": 0.01, "int8": 0.02, "int4": 0.15}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=NEEDS_BF16_MATMUL) if "cpu-bf16" in n else n for n in dense_bandwidth.formats(ROWS)]
)
def test_every_format_computes_the_matmul_and_the_check_catches_a_wrong_weight(name):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 96, generator=generator) * 0.05
    other = torch.randn(128, 96, generator=generator) * 0.05
    x = torch.randn(ROWS, 96, generator=generator).to(torch.bfloat16)
    pack, run = dense_bandwidth.formats(ROWS)[name]
    want = x.float() @ weight.T
    tolerance = TOLERANCE[name.split(",")[0].split()[0]]
    assert relative_error(run(x, pack(weight)), want) < tolerance
    assert relative_error(run(x, pack(other)), want) > 1.0  # independent weights: ~sqrt(2)


@NEEDS_BF16_MATMUL  # (one of the formats is cpu-bf16's)
def test_chain_times_every_format_from_memory_and_cached_and_the_report_shows_them(llama_engine):
    config = EngineConfig.load(llama_engine)
    chain = dense_bandwidth.chain_ms(config, rows=ROWS, repeats=1)
    formats = list(dense_bandwidth.formats(ROWS))
    assert [(r["format"], r["weights"]) for r in chain] == [
        (f, w) for f in formats for w in ("from memory", "one layer's, cached")
    ]
    assert all(r["ms"] > 0 and r["min"] <= r["ms"] <= r["max"] for r in chain)
    payload = {"command": "c", "rows": ROWS, "repeats": 1, "threads": 2, "layers": config.model.num_layers,
               "shapes": dense_bandwidth.layer_shapes(config), "stream_gbps": {"1": 10.0, "2": 20.0},
               "bf16_mb": 1.0, "chain": chain}  # fmt: skip
    report = dense_bandwidth.render(payload)
    assert "10.0 GB/s with 1 thread, 20.0 GB/s with 2" in report
    assert sum(line.startswith(f"| {f} |") for f in formats for line in report.splitlines()) == 2 * len(formats)

"""Error-compensating INT4 rounding (GPTQ, Frantar et al. 2022) on fixed per-block scales.

Round-to-nearest rounds every weight on its own. GPTQ rounds one input column at a time
and spreads that column's rounding error over the columns not yet rounded, weighted by the
inverse of the input second moment H = E[x xᵀ], so the layer's *output* error on calibration
inputs is what gets minimized. The scales (from AWQ's clip search) stay as they are: only
the integer codes change, so the result is the same Q/DQ format TensorRT consumes.

Measured on SmolLM2-135M, INT4 block 32 (held-out perplexity increase / mean KL vs fp32):
AWQ scales with nearest rounding +19% / 0.17; with GPTQ rounding about +8% / 0.11.
"""

from __future__ import annotations

import torch

from calibration.numerics import INT4_MAX, int4_scales

DAMPING = 0.01  # fraction of mean(diag H) added to the diagonal: keeps H invertible
COLUMNS_PER_PASS = 128  # columns rounded before their error is pushed to the rest in one GEMM


@torch.no_grad()
def gptq_int4(weight: torch.Tensor, second_moment: torch.Tensor, block: int, amax: torch.Tensor):
    """-> (q int8 [out, in] in [-8, 7], scales float32 [out, in/block]).

    weight [out, in]; second_moment [in, in] = mean of x xᵀ over calibration tokens of this
    layer's input; amax [out, in/block] fixes each block's scale (amax / 7)."""
    out, inp = weight.shape
    w = weight.clone().float()
    h = second_moment.double().clone()
    dead = torch.diag(h) == 0  # input channels never active: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMPING * torch.diag(h).mean() * torch.eye(inp, dtype=h.dtype)
    # Round the most active input channels first ("act order"): their errors then land on
    # quieter columns. Scales stay with their original blocks, so the format is unchanged.
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    # Upper Cholesky factor of H⁻¹: row i holds how column i's error maps onto later columns.
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    scales = int4_scales(amax).float()
    column_scales = scales[:, order // block]
    q = torch.empty(out, inp, dtype=torch.int8)
    for start in range(0, inp, COLUMNS_PER_PASS):
        end = min(start + COLUMNS_PER_PASS, inp)
        cols = w[:, start:end].clone()
        errors = torch.empty_like(cols)
        for i in range(end - start):
            scale = column_scales[:, start + i]
            code = (cols[:, i] / scale).round().clamp(-INT4_MAX - 1, INT4_MAX)
            q[:, order[start + i]] = code.to(torch.int8)
            errors[:, i] = (cols[:, i] - code * scale) / u[start + i, start + i]
            cols[:, i:] -= errors[:, i : i + 1] * u[start + i, start + i : end]
        w[:, end:] -= errors @ u[start:end, end:]
    return q, scales

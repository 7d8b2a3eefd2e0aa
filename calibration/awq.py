"""Activation-aware weight quantization (AWQ, Lin et al. 2023) for INT4 block weights.

Two searches per linear group, both minimizing the group's output error on sampled
calibration inputs X (rows of the fp32 model's activations):
1. Scale: s = mean|x|^a (normalized), a in a grid over [0, 1). Channels with large
   activations get their weights scaled up before rounding, so their relative rounding error
   shrinks; 1/s is folded into the op that produces X (RMSNorm weight, up_proj rows, V rows),
   so the fp32 function is unchanged. a = 0 is plain round-to-nearest, so the search never
   does worse than RTN on the sample.
2. Clip: per (output channel, block), the block's amax shrunk by up to `max_shrink`, picking
   the one whose rounded block contributes the least output error.

Written here rather than taken from ModelOpt's ONNX PTQ: it runs on the fused [out, in]
matrices of the HF model in torch, before export, so one calibration feeds every graph form
(paged graph, CPU segments, plugin graph) and needs no ONNX calibration feeds for the paged
KV inputs; ModelOpt's ONNX path also fails on graphs holding our plugin ops, and its [onnx]
extra installs onnxruntime-gpu, which breaks the onnxruntime CPU package in one environment.
"""

from __future__ import annotations

import torch

from calibration.numerics import block_amax, int4_fake_quantize


def _output_error(x: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x @ weight.T - reference).pow(2).mean())


@torch.no_grad()
def search_scale(weight: torch.Tensor, x: torch.Tensor, x_abs_mean: torch.Tensor, block: int, grid: int = 20):
    """-> (per-input-channel scale s [in], chosen exponent). weight [out, in], x [rows, in]."""
    reference = x @ weight.T
    best = (float("inf"), torch.ones_like(x_abs_mean), 0.0)
    for step in range(grid):
        ratio = step / grid
        s = x_abs_mean.pow(ratio).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = _output_error(x, int4_fake_quantize(weight * s, block) / s, reference)
        if error < best[0]:
            best = (error, s, ratio)
    return best[1], best[2]


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, block: int, grid: int = 20, max_shrink: float = 0.5):
    """-> per-block amax [out, in/block] minimizing each block's own output error."""
    out, inp = weight.shape
    blocks_w = weight.reshape(out, inp // block, block)
    blocks_x = x.reshape(x.shape[0], inp // block, block)
    # mean_t (x_t . d)^2 = d^T C d with C the block's input second moment: no [rows, out, blocks] temporary.
    moments = torch.einsum("tgb,tgc->gbc", blocks_x, blocks_x) / x.shape[0]
    original = block_amax(weight, block)
    best_amax, best_error = original.clone(), torch.full_like(original, float("inf"))
    for step in range(int(max_shrink * grid)):
        amax = original * (1 - step / grid)
        clipped = torch.maximum(torch.minimum(weight, _expand(amax, block)), -_expand(amax, block))
        diff = int4_fake_quantize(clipped, block, amax).reshape(out, inp // block, block) - blocks_w
        error = torch.einsum("ogb,gbc,ogc->og", diff, moments, diff)  # [out, blocks]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_amax = torch.where(better, amax, best_amax)
    return best_amax


def _expand(per_block: torch.Tensor, block: int) -> torch.Tensor:
    return per_block.repeat_interleave(block, dim=1)

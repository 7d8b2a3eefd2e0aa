"""Quantization number formats, on torch tensors in HF [out, in] layout.

INT4: signed, symmetric (zero point 0, as TensorRT requires), one float scale per block of
`block` consecutive input channels of each output channel: q = clamp(round(w / s), -8, 7),
s = amax / 7. FP8: E4M3, one scale per output channel for weights, s = amax / 448.
"""

from __future__ import annotations

import torch

INT4_MAX = 7
FP8_MAX = 448.0  # largest finite float8 E4M3FN


def int4_scales(amax: torch.Tensor) -> torch.Tensor:
    return (amax / INT4_MAX).clamp(min=1e-10)


def block_amax(weight: torch.Tensor, block: int) -> torch.Tensor:
    """[out, in] -> [out, in/block] max |w| of each block."""
    out, inp = weight.shape
    return weight.reshape(out, inp // block, block).abs().amax(-1)


def int4_quantize(weight: torch.Tensor, block: int, amax: torch.Tensor | None = None):
    """-> (q int8 [out, in] in [-8, 7], scales float32 [out, in/block]). `amax` (per block)
    defaults to the block's max |w|; a smaller one clips (AWQ's clip search picks it)."""
    out, inp = weight.shape
    if inp % block:
        raise ValueError(f"input width {inp} is not a multiple of the INT4 block size {block}")
    amax = block_amax(weight, block) if amax is None else amax
    scales = int4_scales(amax)
    blocks = weight.reshape(out, inp // block, block) / scales[..., None]
    q = blocks.round().clamp(-INT4_MAX - 1, INT4_MAX).to(torch.int8).reshape(out, inp)
    return q, scales.float()


def int4_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out, inp = q.shape
    block = inp // scales.shape[1]
    return (q.float().reshape(out, -1, block) * scales[..., None]).reshape(out, inp)


def int4_fake_quantize(weight: torch.Tensor, block: int, amax: torch.Tensor | None = None) -> torch.Tensor:
    return int4_dequantize(*int4_quantize(weight, block, amax))


def fp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (float8_e4m3fn [out, in], per-output-channel scales float32 [out])."""
    scales = (weight.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    return (weight / scales[:, None]).to(torch.float8_e4m3fn), scales.float()


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]

"""Post-training quantization of a HF decoder's linear layers: FP8, INT4-AWQ, INT4-RTN.

`quantize_model` calibrates on token sequences and returns each fused linear's quantized
weight in the ONNX MatMul layout ([in, out]) for the exporter. It also rewrites the HF model
in place to compute the quantized function (AWQ scales folded, weights fake-quantized), so
the build can verify the exported graph against it. Embeddings stay unquantized; lm_head too unless
`QuantConfig.lm_head` (INT4 only): on SmolLM2-135M the tied 49152x576 head is two thirds of an INT4
engine's weight bytes, and of a single-token step's time when the engine drafts for a larger one.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from calibration import awq
from calibration.activations import InputStats, collect_input_stats
from calibration.gptq import gptq_int4
from calibration.linears import LinearGroup, fused_weight, linear_groups, lm_head_group, set_fused_weight
from calibration.numerics import FP8_MAX, fp8_dequantize, fp8_quantize, int4_dequantize, int4_quantize
from engine_format import ModelSpec

QUANT_METHODS = ("fp8", "int4-awq", "int4-rtn")
INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)
ROUNDING = {
    "int4-awq": "AWQ scale and clip search, then GPTQ error-compensated rounding (act order)",
    "int4-rtn": "round to nearest",
    "fp8": "round to nearest (e4m3)",
}


@dataclass(frozen=True)
class QuantConfig:
    method: str
    block_size: int = 32  # INT4: input channels per scale
    sample_rows: int = 512  # calibration rows kept per linear group for the AWQ searches
    lm_head: bool = False  # INT4: quantize the output projection too (a tied one gets its own copy)

    @property
    def is_int4(self) -> bool:
        return self.method.startswith("int4")

    def problems(self, spec: ModelSpec) -> list[str]:
        """Why this config cannot quantize this model (empty when it can)."""
        if self.method not in QUANT_METHODS:
            return [f"--quantize must be one of {', '.join(QUANT_METHODS)} (got {self.method!r})"]
        if not self.is_int4:
            return [f"--quantize-lm-head needs an INT4 method (got --quantize {self.method})"] if self.lm_head else []
        if self.block_size not in INT4_BLOCK_SIZES:
            return [f"--int4-block-size must be one of {', '.join(map(str, INT4_BLOCK_SIZES))} (got {self.block_size})"]
        widths = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
                  "num_heads*head_dim": spec.num_heads * spec.head_dim}  # fmt: skip
        return [
            f"--int4-block-size {self.block_size} does not divide the model's {name} ({width})"
            for name, width in widths.items()
            if width % self.block_size
        ]


@dataclass(frozen=True)
class QuantizedLinear:
    """One fused MatMul weight, ONNX layout [in, out]."""

    weight: np.ndarray  # ml_dtypes.int4 or ml_dtypes.float8_e4m3fn
    scale: np.ndarray  # float32: INT4 [in/block, out] (DequantizeLinear axis 0); FP8 [out] (axis 1)
    block_size: int | None = None  # INT4
    input_scale: float | None = None  # FP8: per-tensor activation scale (amax / 448)


@torch.no_grad()
def quantize_model(
    model, spec: ModelSpec, config: QuantConfig, sequences: list[list[int]]
) -> tuple[dict[str, QuantizedLinear], dict]:
    """-> (quantized weight per graph MatMul name, a record for the manifest)."""
    groups = linear_groups(spec)
    if config.lm_head:
        groups.append(lm_head_group(spec))
        if spec.tie_word_embeddings:  # the head's fake-quantized weights must not reach the embedding lookup
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    extra: dict = {}
    if config.method == "int4-rtn":  # needs no calibration statistics
        quantized = {g.name: _int4_linear(model, g, *int4_quantize(fused_weight(model, g), config.block_size),
                                          config.block_size) for g in groups}  # fmt: skip
    else:
        awq_method = config.method == "int4-awq"
        stats = collect_input_stats(model, groups, sequences, config.sample_rows, second_moments=awq_method)
        if awq_method:
            quantized, extra = _int4_awq(model, groups, stats, config.block_size)
        else:
            quantized = {g.name: _fp8_linear(model, g, stats[g.name]) for g in groups}
    record = {
        "method": config.method,
        "weights": "int4 symmetric, per block along the input" if config.is_int4 else "fp8 e4m3, per output channel",
        "rounding": ROUNDING[config.method],
        "activations": "fp8 e4m3, per tensor (calibrated amax)" if config.method == "fp8" else "unquantized",
        "block_size": config.block_size if config.is_int4 else None,
        "zero_point": 0,
        "excluded": ["embed_tokens"] if config.lm_head else ["embed_tokens", "lm_head"],
        "quantized_matmuls": len(quantized),
        "calibration_rows_per_group": config.sample_rows if config.method != "int4-rtn" else 0,
        **extra,
    }
    return quantized, record


def _int4_awq(
    model, groups: list[LinearGroup], stats: dict[str, InputStats], block: int
) -> tuple[dict[str, QuantizedLinear], dict]:
    """AWQ scales (all folded before any group is rounded), per-block clip search, GPTQ codes."""
    inputs = {g.name: stats[g.name].sample for g in groups}
    channel_scales, exponents = {}, {}
    for group in groups:
        if group.scale_sink:
            s, exponents[group.name] = _apply_awq_scale(
                model, group, inputs[group.name], stats[group.name].abs_mean, block
            )
            inputs[group.name] = inputs[group.name] / s
            channel_scales[group.name] = s
    quantized = {}
    for group in groups:
        weight = fused_weight(model, group)
        amax = awq.search_clip(weight, inputs[group.name], block)
        second_moment = stats[group.name].second_moment
        if group.name in channel_scales:  # the layer now sees x / s: its second moment is H / (s sᵀ)
            s = channel_scales[group.name].double()
            second_moment = second_moment / (s[:, None] * s[None, :])
        quantized[group.name] = _int4_linear(model, group, *gptq_int4(weight, second_moment, block, amax), block)
    return quantized, {"awq_scale_exponents": exponents}


def _int4_linear(model, group: LinearGroup, q: torch.Tensor, scales: torch.Tensor, block: int) -> QuantizedLinear:
    """Store the group's INT4 codes in the HF model (dequantized) and in ONNX layout."""
    set_fused_weight(model, group, int4_dequantize(q, scales))
    return QuantizedLinear(q.T.numpy().astype(ml_dtypes.int4), scales.T.contiguous().numpy(), block_size=block)


def _fp8_linear(model, group: LinearGroup, stats: InputStats) -> QuantizedLinear:
    q, scales = fp8_quantize(fused_weight(model, group))
    set_fused_weight(model, group, fp8_dequantize(q, scales))
    input_scale = max(float(stats.abs_max.max()) / FP8_MAX, 1e-12)
    return QuantizedLinear(_fp8_numpy(q.T), scales.numpy(), input_scale=input_scale)


def _apply_awq_scale(
    model, group: LinearGroup, x: torch.Tensor, x_abs_mean: torch.Tensor, block: int
) -> tuple[torch.Tensor, float]:
    """Search the group's AWQ scale s, multiply its weights by s and divide its input's
    producer by s; returns s and the chosen exponent."""
    params = dict(model.named_parameters())
    weight = fused_weight(model, group)
    scale, ratio = awq.search_scale(weight, x, x_abs_mean, block)
    set_fused_weight(model, group, weight * scale)
    for name in group.scale_sink:
        param = params[name]
        # Norm weights and biases are vectors over the channels; producer weights are
        # [channels, in], one row per channel.
        param.data.copy_(param.data / (scale if param.dim() == 1 else scale[:, None]))
    return scale, ratio


def _fp8_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)

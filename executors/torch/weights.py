"""The engine's weights as torch tensors (executors/engine_weights.py reads them from the engine directory):
the torch backend's and the cpu-bf16 backend's layers. FP8 engines keep the per-tensor activation
Quantize/Dequantize pair (`Linear.input_scale`), so the numerics are the engine's; every other matmul
runs in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from engine_format import EngineConfig
from executors.engine_weights import WeightReader

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: QuantizeLinear saturates to it


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor  # [in, out], the graph's MatMul layout
    bias: torch.Tensor | None = None
    input_scale: float | None = None  # FP8 engines: the activation's per-tensor Q/DQ scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:  # QuantizeLinear (saturating, round to nearest even) + Dequantize
            q = (x.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            x = (q.float() * self.input_scale).to(x.dtype)
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [hidden, (Hq + 2 Hkv) * D]
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [hidden, 2 * intermediate]
    down: Linear
    window: int  # sliding window in tokens; 0 = full attention


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[Layer]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    cos: torch.Tensor  # [max_seq_len, D / 2] float32: the kernels rotate in float32
    sin: torch.Tensor


def load_weights(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Weights:
    reader = WeightReader(config)
    spec = config.model

    def tensor(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return _as_torch(reader.array(name)).to(device=device, dtype=as_dtype)

    def linear(name: str, bias: bool = False) -> Linear:
        weight, input_scale = reader.linear(name)
        return Linear(
            _as_torch(weight).to(device=device, dtype=dtype), tensor(name + ".bias") if bias else None, input_scale
        )

    layers = [
        Layer(
            input_norm=tensor(f"layer{i}.input_norm.weight"),
            qkv=linear(f"layer{i}.qkv_proj", bias=spec.qkv_bias),
            o_proj=linear(f"layer{i}.o_proj"),
            post_norm=tensor(f"layer{i}.post_norm.weight"),
            gate_up=linear(f"layer{i}.gate_up_proj"),
            down=linear(f"layer{i}.down_proj"),
            window=spec.sliding_windows[i] or 0,
        )
        for i in range(spec.num_layers)
    ]
    embed = tensor("embed_tokens")
    head = reader.untied_lm_head()
    weights = Weights(
        embed=embed,
        layers=layers,
        final_norm=tensor("final_norm.weight"),
        lm_head=embed if head is None else _as_torch(head).to(device=device, dtype=dtype),
        cos=tensor("rope_cos", torch.float32),
        sin=tensor("rope_sin", torch.float32),
    )
    reader.check_shapes(
        {
            "embed_tokens": tuple(weights.embed.shape),
            "lm_head": tuple(weights.lm_head.shape),
            "rope_cos": tuple(weights.cos.shape),
            "layer0.qkv_proj": tuple(layers[0].qkv.weight.shape),
            "layer0.gate_up_proj": tuple(layers[0].gate_up.weight.shape),
        }
    )
    return weights


def _as_torch(array: np.ndarray) -> torch.Tensor:
    """A copy of `array` as a CPU tensor; bfloat16 engines' weights (ml_dtypes.bfloat16, which torch does
    not import from numpy) travel as their bits."""
    copy = np.array(array, copy=True, order="C")
    if copy.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(copy.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(copy)

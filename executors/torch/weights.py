"""The engine's weights as torch tensors, read from the engine directory (no hub).

The exporter (builder/export.py) names every initializer of `model.onnx`; large ones live in
`model.onnx.data` and onnx's external-data loader reads them one tensor at a time (no second
copy of the whole file). Layouts are the graph's: MatMul weights [in, out] with q|k|v and
gate|up fused along `out`, RMSNorm scales [hidden], the embedding and an untied `lm_head`
[vocab, hidden], RoPE tables [max_seq_len, head_dim / 2] (from the HF rotary module, so rope
scaling is already in them). Calibrated engines hold Q/DQ weights (`.qweight`, `.scale`):
they are dequantized here exactly as DequantizeLinear does, so that every matmul runs in the
compute dtype; FP8 engines keep the per-tensor activation Quantize/Dequantize pair
(`Linear.input_scale`), so the numerics are the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import numpy_helper

from engine_format import EngineConfig, EngineLoadError
from engine_format.files import GRAPH_FILE

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
    path = config.engine_dir / GRAPH_FILE
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # protobuf raises its own types for a damaged file
        raise EngineLoadError(f"{path} could not be read ({exc}); rebuild the engine") from None
    found = {t.name: t for t in graph.initializer}
    spec = config.model

    def array(name: str) -> np.ndarray:
        tensor = found.get(name)
        if tensor is None:
            raise EngineLoadError(f"{path.name} has no weight {name!r}: not a trtserve engine of this format")
        try:
            return numpy_helper.to_array(tensor, base_dir=str(config.engine_dir))
        except (OSError, ValueError) as exc:  # missing or truncated model.onnx.data
            raise EngineLoadError(f"{config.engine_dir}: weight {name!r} could not be read ({exc})") from None

    def tensor(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return _as_torch(array(name)).to(device=device, dtype=as_dtype)

    def linear(name: str, bias: bool = False) -> Linear:
        b = tensor(name + ".bias") if bias else None
        if name in found:
            return Linear(tensor(name), b)
        weight, input_scale = _dequantized(array, name)
        return Linear(torch.from_numpy(weight).to(device=device, dtype=dtype), b, input_scale)

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
    weights = Weights(
        embed=embed,
        layers=layers,
        final_norm=tensor("final_norm.weight"),
        lm_head=_lm_head(found, linear, tensor, embed, spec.tie_word_embeddings),
        cos=tensor("rope_cos", torch.float32),
        sin=tensor("rope_sin", torch.float32),
    )
    _check_shapes(config, weights, path)
    return weights


def _lm_head(found: dict, linear: Callable[[str], Linear], tensor: Callable[[str], torch.Tensor],
             embed: torch.Tensor, tied: bool) -> torch.Tensor:  # fmt: skip
    """[vocab, hidden]: an INT4 head (--quantize-lm-head) dequantized, else the embedding when tied."""
    if "lm_head.qweight" in found:
        return linear("lm_head").weight.T.contiguous()
    return embed if tied else tensor("lm_head")


def _as_torch(array: np.ndarray) -> torch.Tensor:
    """A copy of `array` as a CPU tensor; bfloat16 engines' weights (ml_dtypes.bfloat16, which torch does
    not import from numpy) travel as their bits."""
    copy = np.array(array, copy=True, order="C")
    if copy.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(copy.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(copy)


def _dequantized(array: Callable[[str], np.ndarray], name: str) -> tuple[np.ndarray, float | None]:
    """A Q/DQ weight as float32 [in, out]: INT4 blocks along `in` (zero point 0), or FP8 per
    output channel with the activation's scale (builder/export.py `dequantized_operands`)."""
    q, scale = array(name + ".qweight").astype(np.float32), array(name + ".scale").astype(np.float32)
    if scale.ndim == 1:  # FP8: scale [out]
        return q * scale[None, :], float(array(name + ".input_scale"))
    block = -(-q.shape[0] // scale.shape[0])
    return q * np.repeat(scale, block, axis=0)[: q.shape[0]], None


def _check_shapes(config: EngineConfig, w: Weights, path: Path) -> None:
    """The manifest's model against the weights (a mismatched or hand-edited engine)."""
    spec = config.model
    width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    expected = {
        "embed_tokens": (w.embed.shape, (spec.vocab_size, spec.hidden_size)),
        "lm_head": (w.lm_head.shape, (spec.vocab_size, spec.hidden_size)),
        "rope_cos": (w.cos.shape[1:], (spec.head_dim // 2,)),
        "layer0.qkv_proj": (w.layers[0].qkv.weight.shape, (spec.hidden_size, width)),
        "layer0.gate_up_proj": (w.layers[0].gate_up.weight.shape, (spec.hidden_size, 2 * spec.intermediate_size)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise EngineLoadError(f"{path.name}: {name} is {tuple(got)}, the manifest's model needs {want}; rebuild")
    if w.cos.shape[0] < config.max_seq_len:
        raise EngineLoadError(f"{path.name}: RoPE tables cover {w.cos.shape[0]} positions < max_seq_len")

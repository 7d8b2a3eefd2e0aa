"""The decoder's linear layers as the exporter fuses them, and what feeds each one.

Quantization works on the fused matrices the graph holds (one scale search for Q/K/V, which
share their input; one for gate/up), so the calibrated weights map one-to-one onto the
graph's MatMuls. `scale_sink` names the parameters that produce the group's input: AWQ
folds its per-channel scale into them, which leaves the fp32 function unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_format import ModelSpec


@dataclass(frozen=True)
class LinearGroup:
    name: str  # the graph's MatMul name, e.g. "layer3.qkv_proj"
    layer: int
    keys: tuple[str, ...]  # HF modules whose [out, in] weights are stacked along out
    input_module: str  # HF module whose *input* is this group's input (hooked for statistics)
    # HF parameters whose output channels are this group's input channels, or () when the
    # scale cannot be folded exactly (attention output with grouped KV heads).
    scale_sink: tuple[str, ...]


def linear_groups(spec: ModelSpec) -> list[LinearGroup]:
    groups = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        # o_proj's input is a per-query-head mix of V rows: a V channel scale reaches every
        # query head of its group, so folding is exact only without grouped KV heads.
        v_sink = (attn + "v_proj.weight",) + ((attn + "v_proj.bias",) if spec.qkv_bias else ())
        groups += [
            LinearGroup(f"layer{i}.qkv_proj", i, tuple(attn + n for n in ("q_proj", "k_proj", "v_proj")),
                        attn + "q_proj", (p + "input_layernorm.weight",)),
            LinearGroup(f"layer{i}.o_proj", i, (attn + "o_proj",), attn + "o_proj",
                        v_sink if spec.num_heads == spec.num_kv_heads else ()),
            LinearGroup(f"layer{i}.gate_up_proj", i, (mlp + "gate_proj", mlp + "up_proj"),
                        mlp + "gate_proj", (p + "post_attention_layernorm.weight",)),
            LinearGroup(f"layer{i}.down_proj", i, (mlp + "down_proj",), mlp + "down_proj", (mlp + "up_proj.weight",)),
        ]  # fmt: skip
    return groups


def lm_head_group(spec: ModelSpec) -> LinearGroup:
    """The output projection (--quantize-lm-head). Its input is the final norm's; no AWQ scale is folded
    into that norm, because a tied head *is* the embedding table, which must keep its values."""
    return LinearGroup("lm_head", spec.num_layers, ("lm_head",), "lm_head", ())


def fused_weight(model, group: LinearGroup) -> torch.Tensor:
    """The group's weights stacked as HF [out, in] (float32)."""
    modules = dict(model.named_modules())
    return torch.cat([modules[k].weight.detach().float() for k in group.keys], dim=0)


def set_fused_weight(model, group: LinearGroup, weight: torch.Tensor) -> None:
    """Write a stacked [out, in] matrix back into the group's HF modules."""
    modules = dict(model.named_modules())
    start = 0
    for key in group.keys:
        param = modules[key].weight
        rows = param.shape[0]
        param.data.copy_(weight[start : start + rows].to(param.dtype))
        start += rows

"""A LoRA adapter in the PEFT format (`adapter_config.json` + `adapter_model.safetensors`, as HF `peft` saves
them), read and checked against the engine it will run on.

Each targeted projection W [out, in] of a layer gets W + scaling * B @ A, with A [r, in] and B [out, r];
scaling is lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), r being that module's own rank (PEFT's
`rank_pattern` gives modules different ranks: the tensors' shapes say which). Everything an adapter could
do that this runtime does not is refused here, with the field that asks for it, before any weight reaches
a serving engine: DoRA, trained biases, extra trainable modules (modules_to_save), per-module alphas,
transposed (fan_in_fan_out) weights, targets other than the decoder's seven projections, a rank above the
server's limit, and weights whose shapes are another model's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_format import ModelSpec

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder's projections, as HF Llama-family models name them (PEFT's target_modules), and where they sit.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot run on this engine: `field` names what is wrong (a config key or a file)."""

    def __init__(self, name: str, field: str, message: str):
        super().__init__(f"LoRA adapter {name!r}: {field}: {message}")
        self.field = field


@dataclass(frozen=True)
class LoraModule:
    """One projection's update: delta = scaling * x @ a.T @ b.T (float32)."""

    a: np.ndarray  # [rank, in]
    b: np.ndarray  # [out, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the largest module rank
    targets: tuple[str, ...]  # the projections it changes, in TARGETS order
    modules: dict[tuple[int, str], LoraModule]  # (layer, target) -> update
    digest: str  # SHA-256 of its config and weights: its identity in the prefix cache and between replicas

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def module_shape(spec: ModelSpec, target: str) -> tuple[int, int]:
    """(in, out) of a projection of the engine's model."""
    q, kv, hidden, inter = spec.num_heads * spec.head_dim, spec.kv_width, spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]


def _read_config(name: str, path: Path, max_rank: int) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(name, CONFIG_FILE, f"not found in {path} (a PEFT adapter directory holds it)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(name, CONFIG_FILE, f"could not be parsed ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(name, CONFIG_FILE, "must be a JSON object")
    refused = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LORA adapters are served"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (config.get("bias", "none") != "none", "trained biases are not supported (only 'none')"),
        "lora_bias": (bool(config.get("lora_bias")), "trained LoRA biases are not supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "extra trainable modules are not supported"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module lora_alpha is not supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "transposed (Conv1D) weights are not supported"),
    }
    for field, (bad, why) in refused.items():
        if bad:
            raise AdapterError(name, field, f"{why} (got {config.get(field)!r})")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(name, "r", f"must be a positive integer (got {rank!r})")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise AdapterError(name, "r", f"rank {max(ranks)} is above the server's max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise AdapterError(name, "lora_alpha", f"must be a positive number (got {alpha!r})")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    # A string is PEFT's regex over module names: the weights say which modules it matched (checked below).
    unknown = [t for t in names if t not in TARGETS] if not isinstance(targets, str) else []
    if unknown:
        raise AdapterError(name, "target_modules", f"{unknown} are not supported; targets may be {list(TARGETS)}")
    return config


def _read_weights(name: str, path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(name, WEIGHTS_FILE, f"not found in {path} (save the adapter with safetensors)")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(name, WEIGHTS_FILE, f"could not be read ({exc})") from None


def load_adapter(
    name: str, path: str | Path, spec: ModelSpec, max_rank: int, base_model: str | None = None
) -> LoraAdapter:
    """Read and check an adapter directory for the engine's model `spec` (AdapterError naming the field).
    `base_model`: the engine's source model name; another `base_model_name_or_path` is only a warning (one
    model goes by several names), wrong shapes are the error."""
    path = Path(path)
    config = _read_config(name, path, max_rank)
    named = config.get("base_model_name_or_path")
    if base_model and named and Path(base_model).name.lower() not in Path(str(named)).name.lower():
        log.warning("LoRA adapter %r names base model %r, the engine was built from %r", name, named, base_model)
    weights = _read_weights(name, path)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in weights.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(name, WEIGHTS_FILE, f"tensor {key!r} is not a LoRA A/B weight of a decoder projection")
        layer, target, side = int(match[1]), match[2], match[3]
        if target not in TARGETS:
            raise AdapterError(name, "target_modules", f"{target} is not supported; targets may be {list(TARGETS)}")
        if layer >= spec.num_layers:
            raise AdapterError(name, WEIGHTS_FILE, f"layer {layer} is past the engine's {spec.num_layers} layers")
        pairs.setdefault((layer, target), {})[side] = tensor
    if not pairs:
        raise AdapterError(name, WEIGHTS_FILE, "holds no LoRA weights")
    alpha, rslora = float(config.get("lora_alpha", config["r"])), bool(config.get("use_rslora"))
    modules: dict[tuple[int, str], LoraModule] = {}
    for (layer, target), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise AdapterError(name, WEIGHTS_FILE, f"layer {layer} {target} lacks its lora_A or lora_B weight")
        a, b = sides["A"].astype(np.float32), sides["B"].astype(np.float32)
        fan_in, fan_out = module_shape(spec, target)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
            raise AdapterError(
                name,
                WEIGHTS_FILE,
                f"layer {layer} {target}: lora_A {a.shape} and lora_B {b.shape} do not fit the engine's {target} "
                f"({fan_in} in, {fan_out} out): the adapter was trained for another base model",
            )
        if a.shape[0] > max_rank:
            raise AdapterError(name, "r", f"rank {a.shape[0]} is above the server's max_lora_rank {max_rank}")
        rank = a.shape[0]
        modules[layer, target] = LoraModule(a, b, alpha / (math.sqrt(rank) if rslora else rank))
    digest = hashlib.sha256((path / CONFIG_FILE).read_bytes() + (path / WEIGHTS_FILE).read_bytes()).hexdigest()
    return LoraAdapter(
        name=name,
        path=path,
        rank=max(m.rank for m in modules.values()),
        targets=tuple(t for t in TARGETS if any(target == t for _, target in modules)),
        modules=modules,
        digest=digest,
    )

"""benchmarks/lora.py's adapters and requests: seeded PEFT adapters made for the run, each request's adapter
(round robin or a seeded random pick), and a sender that puts each request's adapter in its `model`.

Adapters: rank r, lora_alpha r (scaling 1), on q_proj, k_proj, v_proj and o_proj (trtserve's `cpu` backend applies
LoRA to those four only and refuses MLP targets), PEFT's default init (A Kaiming-uniform, B zero) with B then drawn
from N(0, b_std²): every adapter computes and changes the output, which stays fluent at b_std 0.02 (the point is
realistic compute, not meaningful text).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from benchmarks import client
from benchmarks.datasets import BenchRequest, ChatRequest

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class AdapterRequest(ChatRequest):
    """A chat request naming its model: an adapter, or None for the server's base model."""

    model: str | None = None


def adapter_names(count: int) -> list[str]:
    return [f"a{i}" for i in range(count)]


def make_adapters(checkpoint: Path, out: Path, names: list[str], rank: int, b_std: float, seed: int) -> dict[str, Path]:
    """A PEFT adapter of the checkpoint per name in out/<name> (module docstring), the i-th seeded seed + i."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGET_MODULES))
    paths = {}
    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        peft_model = get_peft_model(copy.deepcopy(model), config)
        with torch.no_grad():
            for key, weight in peft_model.named_parameters():
                if "lora_B" in key:
                    weight.normal_(0.0, b_std)
        peft_model.save_pretrained(str(out / name))
        paths[name] = out / name
    return paths


def assign(count: int, names: list[str], how: str, seed: int) -> list[str]:
    """The adapter of each of `count` requests: round robin over `names`, or a seeded random pick."""
    if how == "round-robin":
        return [names[i % len(names)] for i in range(count)]
    if how == "random":
        rng = random.Random(seed)
        return [rng.choice(names) for _ in range(count)]
    raise ValueError(f"assignment {how!r}: round-robin or random")


def with_models(requests: list[ChatRequest], models: list[str] | None) -> list[AdapterRequest]:
    values = ({f.name: getattr(r, f.name) for f in fields(r)} for r in requests)
    return [AdapterRequest(**v, model=None if models is None else models[i]) for i, v in enumerate(values)]


def sender(endpoint: client.Endpoint) -> client.Sender:
    """client.send_chat with each request's model (the endpoint's for base-model requests)."""

    def send(session: Any, req: BenchRequest) -> Any:
        model = req.model if isinstance(req, AdapterRequest) and req.model else endpoint.model
        return client.send_chat(session, replace(endpoint, model=model), req)

    return send

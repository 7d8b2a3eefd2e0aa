"""The decoder architecture an engine was built for, as written in its manifest."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_type: str
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def kv_width(self) -> int:
        """Elements per token per layer for K (and for V): kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        data["sliding_windows"] = tuple(data["sliding_windows"])
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        return cls(**data)

"""The decoder spec of a Hugging Face checkpoint, read from its config."""

from __future__ import annotations

from builder.errors import ModelSourceError
from engine_format import ModelSpec

# Rope types whose cos/sin depend only on the position (not on the running sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def model_spec_from_hf_config(config) -> ModelSpec:
    """Read the architecture facts the exporter needs; an unsupported variant fails here,
    with one clear message, before any export work starts."""
    where = f"model config ({config.model_type})"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ModelSourceError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
    if getattr(config, "mlp_bias", False):
        raise ModelSourceError(f"{where}: mlp_bias=true is not supported")
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelSourceError(
            f"{where}: rope_type={rope_type!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return ModelSpec(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.rms_norm_eps),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        rope_type=rope_type,
        max_position_embeddings=config.max_position_embeddings,
        sliding_windows=_sliding_windows(config),
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos_ids,
    )


def _sliding_windows(config) -> tuple[int | None, ...]:
    """Per-layer window, following how each HF architecture applies `sliding_window`."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # Qwen2 and newer configs say it per layer
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    # Mistral applies its window to every layer when one is set.
    return tuple([window] * config.num_hidden_layers)

"""Tiny random-weight Llama-family checkpoints, built on the fly (seeded) for fast tests.

Each covers a different corner of the architecture family: tied vs untied embeddings,
rope scaling, QKV biases (Qwen2), sliding-window attention (Mistral), GQA ratios.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "A paged KV cache stores keys and values in fixed-size blocks shared across requests.",
    "Large language models generate one token at a time; batching keeps the hardware busy.",
    "def add(a, b):\n    return a + b\n# numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Über café naïve — 東京 北京 😀 🚀 emoji and accents make byte-level tokenizers work.",
]

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (model_type, config overrides)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", dict(tie_word_embeddings=True)),
    "tiny-llama-rope-scaled": (
        "llama",
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=3,
            num_key_value_heads=1,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "tiny-qwen2": ("qwen2", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "tiny-mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=24)),
}


def make_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in milliseconds on a built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_checkpoint(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a seeded random-weight checkpoint (config, safetensors, tokenizer) to out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = TINY_MODELS[name]
    tokenizer = make_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init std 0.02 gives near-uniform logits; widen it so greedy choices are
    # decisive and parity tests compare meaningful argmaxes rather than near-ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def cached_tiny_checkpoint(name: str, models_dir: Path, seed: int = 0) -> Path:
    """The checkpoint directory of tiny model `name`, made once under models_dir."""
    target = models_dir / f"{name}-seed{seed}"
    if not (target / "config.json").is_file():
        models_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=models_dir))
        try:
            make_tiny_checkpoint(name, staging, seed)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target

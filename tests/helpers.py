"""Reference computations for tests: HF eager, run independently of the engine."""

from __future__ import annotations

import numpy as np
import torch


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    """Logits [len, vocab] of HF eager for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids),
            pad_token_id=stop_ids[0],
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, n).tolist() for n in lengths]

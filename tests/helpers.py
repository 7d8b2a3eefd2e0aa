"""Reference computations for tests (HF eager, run independently of the engine), a way to break an engine,
and a step-by-step engine driver."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import pytest
import torch

from executors.cpus import bf16_matmul

# The cpu-bf16 backend's dense layers are oneDNN bfloat16 matmuls, which refuse CPUs without them (AVX2-only ones).
NEEDS_BF16_MATMUL = pytest.mark.skipif(
    not bf16_matmul(), reason="this CPU has no oneDNN bfloat16 matmul (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): cpu-bf16"
)

if TYPE_CHECKING:
    from runtime import LLMEngine


# Token-exact comparisons (with HF float32, across batch compositions, with speculation on and off) need the
# float32 CPU backend: cpu-bf16, the default on CPUs with AMX, rounds its bfloat16 matmuls differently for
# another row count, which flips near-ties (tests/test_cpu_bf16_default.py); cpu-int8, the default on CPUs with
# AVX512-VNNI or AVX2, quantizes (tests/test_cpu_int8.py).
FLOAT32_BACKEND = "cpu"


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


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm in torch ops: normalize in float32, back to the compute dtype, then scale."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, n).tolist() for n in lengths]


def _scale_initializers(engine: Path) -> list[onnx.TensorProto]:
    model = onnx.load(engine / "model.onnx", load_external_data=False)
    return [t for t in model.graph.initializer if t.name.endswith(".scale")]


def corrupt_scales(engine: Path, factor: float) -> None:
    """Multiply the INT4 scales stored in the weights file (float32), in place; small ones
    inlined in the graph files are left alone."""
    data = engine / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    external = [t for t in _scale_initializers(engine) if t.external_data]
    assert external
    for tensor in external:
        info = {e.key: e.value for e in tensor.external_data}
        start, length = int(info.get("offset", 0)), int(info["length"])
        values = np.frombuffer(raw[start : start + length], np.float32) * factor
        raw[start : start + length] = values.astype(np.float32).tobytes()
    data.write_bytes(bytes(raw))


def run_with_arrivals(engine: LLMEngine, prompts, params, arrival_steps) -> dict[int, list[int]]:
    """Add prompt i at engine step arrival_steps[i]; returns generated ids per prompt."""
    ids: dict[str, int] = {}
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        for i, at in enumerate(arrival_steps):
            if at == step:
                ids[engine.add_request(prompts[i], params)] = i
        for delta in engine.step():
            out[ids[delta.request_id]] += delta.token_ids
        engine.check_invariants()
        step += 1
    return out


def make_lora_adapter(model, out: Path, targets: list[str], rank: int, alpha: float, seed: int, **options) -> Path:
    """A PEFT LoRA adapter of `model` saved to `out`, with random non-zero A and B (PEFT's init_lora_weights=False),
    so it changes the model's output. `options`: more LoraConfig fields (use_rslora, ...)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **options)
    get_peft_model(copy.deepcopy(model), config).save_pretrained(out)
    return out


def with_lora(model, adapter: Path | None):
    """HF eager + PEFT: a copy of `model` running `adapter` (the model itself for None)."""
    import copy

    from peft import PeftModel

    return model if adapter is None else PeftModel.from_pretrained(copy.deepcopy(model), adapter).eval()

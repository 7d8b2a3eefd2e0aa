"""Multi-LoRA on SmolLM2-135M (the default real model): four PEFT adapters and the base model in one mixed batch,
each request's greedy tokens against HF eager + PEFT for its adapter (the float32 `cpu` backend: identical);
cpu-bf16 and cpu-int8 within their verified tolerances (tests/test_smollm2.py, tests/test_cpu_int8.py) on an
adapter of every projection."""

from __future__ import annotations

import numpy as np
import pytest

from engine_format import EngineConfig
from executors import create_backend
from executors.base import SequenceChunk
from executors.lora import load_adapter
from runtime import LLM, SamplingParams
from runtime.engine.tokenizer import encode_prompt, stop_token_ids
from tests.helpers import NEEDS_BF16_MATMUL, hf_greedy, hf_logits, make_lora_adapter, with_lora

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = {  # name -> (targets, rank, alpha, seed, LoraConfig options)
    "qv": (["q_proj", "v_proj"], 8, 16, 1, {}),
    "kv": (["k_proj", "v_proj"], 16, 16, 2, {}),
    "qo-rs": (["q_proj", "o_proj"], 32, 8, 3, {"use_rslora": True}),
    "attn": (ATTENTION, 64, 32, 4, {}),
    "all": ([*ATTENTION, "gate_proj", "up_proj", "down_proj"], 16, 16, 5, {}),
}
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in simple words why the sky is blue.",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Give me a short tip for learning to cook.",
]


@pytest.fixture(scope="module")
def adapters(smollm2_hf, tmp_path_factory):
    model, _ = smollm2_hf
    root = tmp_path_factory.mktemp("smollm2-loras")
    return {
        name: make_lora_adapter(model, root / name, targets, rank, alpha, seed, **options)
        for name, (targets, rank, alpha, seed, options) in ADAPTERS.items()
    }


def test_four_adapters_and_the_base_model_in_one_batch_match_hf_peft(smollm2_engine, smollm2_hf, adapters):
    model, tokenizer = smollm2_hf
    names = [None, "qv", "kv", "qo-rs", "attn", None]
    attention_only = {n: str(adapters[n]) for n in names if n is not None}
    with LLM(smollm2_engine, backend="cpu", lora_modules=attention_only) as llm:
        stop = tuple(sorted(stop_token_ids(tokenizer, llm.engine.config)))
        prompts = [encode_prompt(tokenizer, p, chat=True) for p in PROMPTS]
        params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, lora=n) for n in names]
        outputs = llm.generate(prompts, params)
    answers = {}
    for name, prompt, output in zip(names, prompts, outputs, strict=True):
        answers[name] = hf_greedy(with_lora(model, adapters.get(name or "")), prompt, NEW_TOKENS, stop)
        assert output.token_ids == answers[name], (name, output.text, tokenizer.decode(answers[name]))
    base = hf_greedy(model, prompts[1], NEW_TOKENS, stop)
    assert answers["qv"] != base, "the adapter changes the answer"


@pytest.mark.parametrize(
    ("kind", "headroom"), [pytest.param("cpu-bf16", 1.25, marks=NEEDS_BF16_MATMUL), ("cpu-int8", 2.0)]
)
def test_an_adapter_of_every_projection_within_the_backends_tolerance(
    smollm2_engine, smollm2_hf, adapters, kind, headroom
):
    """Each prompt's logits under `all` (beside a base chunk in the same step) are no further from HF float32 +
    PEFT than the backend's base-model logits are from HF float32 (x headroom: tests/test_smollm2.py's margin for
    cpu-bf16, and cpu-int8's quantization of the adapted activations), and much closer to them than the base
    model's are: the adapter's effect (logits moved by up to ~11) is there."""
    model, tokenizer = smollm2_hf
    backend = create_backend(EngineConfig.load(smollm2_engine), kind=kind)
    slots = backend.enable_lora(1, 64)
    slots.load(0, load_adapter("all", adapters["all"], backend.config.model, 64))
    adapted = with_lora(model, adapters["all"])
    for i, text in enumerate(PROMPTS[:3]):
        tokens = encode_prompt(tokenizer, text, chat=True)
        blocks = -(-len(tokens) // backend.config.block_size)
        chunks = [
            SequenceChunk(tokens, 0, list(range(blocks)), len(tokens), lora_slot=0),
            SequenceChunk(tokens, 0, list(range(blocks, 2 * blocks)), len(tokens)),
        ]
        logits = backend.step(chunks)
        ours, ours_base = logits[: len(tokens)], logits[len(tokens) :]
        ref, ref_base = hf_logits(adapted, tokens), hf_logits(model, tokens)
        error, base_error = np.abs(ours - ref).max(), np.abs(ours_base - ref_base).max()
        assert error <= headroom * base_error + 1e-3, (kind, i)
        assert error < 0.5 * np.abs(ref - ref_base).max(), (kind, i)


def test_the_check_catches_an_adapter_run_as_another(smollm2_engine, smollm2_hf, adapters):
    model, tokenizer = smollm2_hf
    with LLM(smollm2_engine, backend="cpu", lora_modules={"qv": str(adapters["attn"])}) as llm:  # the wrong files
        tokens = encode_prompt(tokenizer, PROMPTS[1], chat=True)
        (output,) = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, lora="qv"))
        stop = tuple(sorted(stop_token_ids(tokenizer, llm.engine.config)))
    want, other = (hf_greedy(with_lora(model, adapters[n]), tokens, NEW_TOKENS, stop) for n in ("qv", "attn"))
    assert want != other  # the two adapters answer differently here...
    assert output.token_ids != want  # ...so running one as the other is caught

"""Multi-LoRA serving in the engine: adapters made with PEFT on the tiny Llama, mixed in one batch with base-model
requests, against HF eager + PEFT; the adapters' checks; slots; prefix-cache isolation; removal under load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from builder.sources import load_checkpoint, resolve_model
from engine_format import EngineConfig, EngineLoadError
from executors import create_backend
from executors.base import SequenceChunk
from executors.lora import AdapterError, load_adapter
from runtime import LLM, LLMEngine, SamplingParams
from runtime.engine.engine_args import EngineArgs
from runtime.engine.errors import InvalidRequest
from tests.helpers import NEEDS_BF16_MATMUL, hf_greedy, hf_logits, make_lora_adapter, random_prompts, with_lora

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (targets, rank, alpha, seed, LoraConfig options): ranks 8-64, rsLoRA, every projection.
ADAPTERS = {
    "qv": (["q_proj", "v_proj"], 8, 16, 1, {}),
    "kv": (["k_proj", "v_proj"], 16, 8, 2, {}),
    "qo-rs": (["q_proj", "o_proj"], 32, 32, 3, {"use_rslora": True}),
    "attn": (ATTENTION, 64, 64, 4, {}),
}
MLP_ADAPTER = ("all", (ATTENTION + MLP, 8, 16, 5, {}))
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hf_model():
    return load_checkpoint(resolve_model("tiny-llama"))[0]


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        name: make_lora_adapter(hf_model, root / name, targets, rank, alpha, seed, **options)
        for name, (targets, rank, alpha, seed, options) in [*ADAPTERS.items(), MLP_ADAPTER]
    }


def greedy(lora: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, lora=lora)


def test_mixed_batch_matches_hf_peft_per_adapter(llama_engine, hf_model, adapters):
    """Four adapters and the base model in one batch, with two slots (adapters are paged in and out between
    requests): each request's greedy tokens are HF + PEFT's for its adapter."""
    attention_only = {name: str(adapters[name]) for name in ADAPTERS}
    names = [None, *ADAPTERS, None, "qv", "attn"]
    prompts = random_prompts(hf_model.config.vocab_size, [7, 19, 30, 12, 25, 9, 16, 40], seed=3)
    with LLM(llama_engine, backend="cpu", lora_modules=attention_only, max_loras=2) as llm:
        outputs = llm.generate(prompts, [greedy(name) for name in names])
        stats = llm.engine.stats().lora
    for name, prompt, output in zip(names, prompts, outputs, strict=True):
        reference = hf_greedy(with_lora(hf_model, adapters.get(name or "")), prompt, NEW_TOKENS, (10**9,))
        assert output.token_ids == reference, name
    base = [hf_greedy(hf_model, p, NEW_TOKENS, (10**9,)) for p in prompts]
    assert all(o.token_ids != b for o, b, n in zip(outputs, base, names, strict=True) if n), "adapters change output"
    assert stats is not None and stats.slot_loads >= 4 and stats.slot_evictions >= 2
    assert stats.requests == {"qv": 2, "kv": 1, "qo-rs": 1, "attn": 2}
    assert stats.tokens["qv"] == 2 * NEW_TOKENS


def test_a_swapped_adapter_is_caught(llama_engine, hf_model, adapters):
    """The check above can fail: a request run under another adapter differs from its adapter's reference."""
    prompt = random_prompts(hf_model.config.vocab_size, [20], seed=5)[0]
    with LLM(llama_engine, backend="cpu", lora_modules={"qv": str(adapters["kv"])}) as llm:  # the wrong files
        (output,) = llm.generate([prompt], greedy("qv"))
    assert output.token_ids != hf_greedy(with_lora(hf_model, adapters["qv"]), prompt, NEW_TOKENS, (10**9,))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cpu-bf16", marks=NEEDS_BF16_MATMUL)])
def test_backend_logits_per_slot(llama_engine, hf_model, adapters, kind):
    """One step of chunks under different slots (prefill chunks and a base chunk between them) against HF
    float32 + PEFT. cpu: float32, to 1e-4. cpu-bf16: no further from float32 than HF's own bfloat16 forward
    with the adapter (x 1.5, as tests/test_cpu_bf16.py bounds the base model)."""
    backend = create_backend(EngineConfig.load(llama_engine), num_blocks=64, kind=kind)
    slots = backend.enable_lora(4, 64)
    names = ["qv", "attn", "qo-rs"] + (["all"] if kind == "cpu-bf16" else [])
    for slot, name in enumerate(names):
        slots.load(slot, load_adapter(name, adapters[name], backend.config.model, 64))
    prompts = random_prompts(hf_model.config.vocab_size, [11, 23, 17, 9, 14], seed=7)
    lora_slots = [0, None, 1, 2, 3 if kind == "cpu-bf16" else 0]
    chunks = [
        SequenceChunk(p, 0, list(range(8 * i, 8 * i + 4)), len(p), lora_slot=s)
        for i, (p, s) in enumerate(zip(prompts, lora_slots, strict=True))
    ]
    logits = backend.step(chunks)
    row = 0
    for prompt, slot in zip(prompts, lora_slots, strict=True):
        adapter = None if slot is None else adapters[names[slot]]
        ref = hf_logits(with_lora(hf_model, adapter), prompt)
        got = logits[row : row + len(prompt)]
        row += len(prompt)
        if kind == "cpu":
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
        else:
            ref16 = hf_logits(with_lora(hf_model.to(torch.bfloat16), adapter), prompt)
            hf_model.to(torch.float32)
            assert np.abs(got - ref).max() <= 1.5 * np.abs(ref16 - ref).max() + 1e-3, names[slot] if slot else None


@NEEDS_BF16_MATMUL
def test_an_adapter_of_every_projection_runs_on_cpu_bf16_and_is_refused_on_cpu(llama_engine, hf_model, adapters):
    """An adapter of every projection runs on cpu-bf16; on `cpu`, whose segments fuse the MLP, it is refused
    naming the targets and the backend that serves them."""
    with pytest.raises(EngineLoadError, match=r"target_modules.*gate_proj.*--backend cpu-bf16"):
        LLM(llama_engine, backend="cpu", lora_modules={"all": str(adapters["all"])})
    with LLM(llama_engine, backend="cpu-bf16", lora_modules={"all": str(adapters["all"])}) as llm:
        (output,) = llm.generate([[5, 6, 7, 8]], greedy("all"))
    assert len(output.token_ids) == NEW_TOKENS


def _rewrite_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "adapter_config.json").read_text()) | changes
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_adapters_that_cannot_run_are_refused_with_their_reason(llama_engine, adapters, tmp_path):
    spec = EngineConfig.load(llama_engine).model
    other = load_checkpoint(resolve_model("tiny-qwen2"))[0]  # another model: other shapes
    wrong_base = make_lora_adapter(other, tmp_path / "qwen", ["q_proj", "v_proj"], 8, 16, 0)
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter("qwen", wrong_base, spec, 64)
    with pytest.raises(AdapterError, match=r"^LoRA adapter 'attn': r: rank 64 is above the server's max_lora_rank 32"):
        load_adapter("attn", adapters["attn"], spec, 32)
    bad = {
        "use_dora": (True, "use_dora: DoRA"),
        "modules_to_save": (["lm_head"], "modules_to_save"),
        "target_modules": (["q_proj", "embed_tokens"], r"target_modules: \['embed_tokens'\] are not supported"),
        "bias": ("all", "bias: trained biases"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(AdapterError, match=message):
            load_adapter(field, _rewrite_config(adapters["qv"], tmp_path / field, **{field: value}), spec, 64)
    broken = _rewrite_config(adapters["qv"], tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: could not be read"):
        load_adapter("broken", broken, spec, 64)
    with pytest.raises(AdapterError, match=r"adapter_config\.json: not found"):
        load_adapter("none", tmp_path, spec, 64)
    # At start: the server does not come up with an adapter it cannot run.
    with pytest.raises(EngineLoadError, match="another base model"):
        LLM(llama_engine, backend="cpu", lora_modules={"qwen": str(wrong_base)})


def test_unknown_adapter_and_lora_without_adapters_are_refused(llama_engine, adapters):
    engine = LLMEngine(llama_engine, EngineArgs(backend="cpu", lora_modules=f"qv={adapters['qv']}"))
    with pytest.raises(InvalidRequest, match=r"lora: adapter 'nope' is not loaded \(loaded: qv\)"):
        engine.add_request([1, 2, 3], greedy("nope"))
    plain = LLMEngine(llama_engine, EngineArgs(backend="cpu"))
    with pytest.raises(InvalidRequest, match="lora: adapter 'qv': this server serves no LoRA adapters"):
        plain.add_request([1, 2, 3], greedy("qv"))
    assert not engine.requests and not plain.requests
    with pytest.raises(ValueError, match="'qv' must be NAME=DIR"):
        EngineArgs(lora_modules="qv")


def test_a_prefix_cached_under_one_adapter_is_a_miss_under_another(llama_engine, adapters):
    engine = LLMEngine(
        llama_engine,
        EngineArgs(backend="cpu", lora_modules=f"qv={adapters['qv']},kv={adapters['kv']}", num_kv_blocks=32),
    )
    prompt = list(range(10, 35))  # three full blocks of 8, and one token

    def hits(lora: str | None) -> list[int]:
        """The prefix-cache hits of the prompt under `lora`, by block id; then run it."""
        request = engine.requests[engine.add_request(prompt, greedy(lora))]
        found = [b.block_id for b in engine.kv.get_computed_blocks(request)]
        finish_all(engine)
        return found

    assert hits("qv") == []
    assert hits("qv") == [0, 1, 2]  # the first run's blocks
    assert hits("kv") == []  # the same tokens under another adapter
    assert hits(None) == []  # nor the base model
    kv_blocks, base_blocks = hits("kv"), hits(None)  # each has its own copies now
    assert len(kv_blocks) == len(base_blocks) == 3
    assert not {0, 1, 2} & set(kv_blocks) and not {0, 1, 2} & set(base_blocks) and not set(kv_blocks) & set(base_blocks)
    engine.check_invariants()


def finish_all(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until every request ends; each request's generated tokens."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_removing_an_adapter_under_load_loses_nothing(llama_engine, hf_model, adapters):
    engine = LLMEngine(llama_engine, EngineArgs(backend="cpu", lora_modules=f"qv={adapters['qv']}", max_loras=1))
    prompts = random_prompts(hf_model.config.vocab_size, [12, 18, 9], seed=11)
    ids = [engine.add_request(p, greedy("qv")) for p in prompts]
    first = {out.request_id: list(out.token_ids) for out in engine.step()}
    with pytest.raises(AdapterError, match=r"adapter_config\.json: not found"):  # a failed load changes nothing
        engine.add_lora("missing", adapters["qv"] / "nowhere")
    assert engine.remove_lora("qv") is False  # in use: it leaves when they finish
    with pytest.raises(InvalidRequest, match="adapter 'qv' is not loaded"):
        engine.add_request([1, 2, 3], greedy("qv"))
    rest = finish_all(engine)
    reference = with_lora(hf_model, adapters["qv"])
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert first.get(request_id, []) + rest[request_id] == hf_greedy(reference, prompt, NEW_TOKENS, (10**9,))
    assert engine.stats().lora.registered == ()
    assert engine.loras is not None and engine.loras.slots.names == [None]
    engine.add_lora("qv2", adapters["qv"])  # loaded again at run time, under another name
    again = engine.add_request(prompts[0], greedy("qv2"))
    assert finish_all(engine)[again] == first.get(ids[0], []) + rest[ids[0]]

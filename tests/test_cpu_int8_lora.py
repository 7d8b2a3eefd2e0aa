"""LoRA on the cpu-int8 backend: adapters made with PEFT on the tiny Llama (every projection, ranks 8-64, rsLoRA),
mixed with base-model chunks in one step, against HF float32 + PEFT.

Tolerance: the base projections are W8A8 (a few percent of the largest logit, tests/test_cpu_int8.py); the
adapters' updates are float32 from the projections' real inputs. So a chunk under an adapter is no further from
HF + PEFT than the same prompt on the base model is from HF (x LORA_ERROR; measured 0.8-1.3x), and the adapter's
effect, int8 with it minus int8 without, is HF's to within DELTA_ERROR of its size (measured 3.7-5.7%). A fault
in the smoothed space (up's update not divided by down's factors, down's input not multiplied back) or the
wrong slot moves logits by about the effect itself, which `test_the_bounds_catch_*` show.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from builder.sources import load_checkpoint, resolve_model
from calibration.activations import activation_ranges
from engine_format import EngineConfig
from engine_format.files import ACTIVATION_RANGES_FILE
from executors import create_backend
from executors.base import SequenceChunk
from executors.lora import load_adapter
from runtime import LLM, SamplingParams
from tests.helpers import hf_logits, make_lora_adapter, random_prompts, with_lora

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# slot order; name -> (targets, rank, alpha, seed, LoraConfig options)
ADAPTERS = {
    "qv": (["q_proj", "v_proj"], 8, 16, 1, {}),
    "attn": (ATTENTION, 64, 64, 4, {}),
    "mlp-rs": (MLP, 32, 32, 3, {"use_rslora": True}),
    "all": (ATTENTION + MLP, 16, 16, 5, {}),
}
NAMES = list(ADAPTERS)
SLOTS = [0, None, 2, 1, 3, 2]  # per chunk; base chunks and one slot's rows apart in the flat step
LENGTHS = [11, 23, 17, 9, 14, 12]
LORA_ERROR = 2.0
DELTA_ERROR = 0.15


@pytest.fixture(scope="module")
def hf_model():
    return load_checkpoint(resolve_model("tiny-llama"))[0]


@pytest.fixture(scope="module")
def engine(llama_engine, hf_model, tmp_path_factory) -> Path:
    """The tiny Llama engine with activation ranges (its build measures them only where cpu-int8 is gated): the
    smoothing factors the backend folds in, which the adapters' inputs must undo."""
    if (llama_engine / ACTIVATION_RANGES_FILE).is_file():
        return llama_engine
    copy = tmp_path_factory.mktemp("int8") / "engine"
    shutil.copytree(llama_engine, copy)
    spec = EngineConfig.load(copy).model
    np.savez(
        copy / ACTIVATION_RANGES_FILE, **activation_ranges(hf_model, spec, random_prompts(spec.vocab_size, [64] * 4))
    )
    return copy


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int8-loras")
    return {
        name: make_lora_adapter(hf_model, root / name, targets, rank, alpha, seed, **options)
        for name, (targets, rank, alpha, seed, options) in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def backend(engine, adapters):
    backend = create_backend(EngineConfig.load(engine), num_blocks=64, kind="cpu-int8")
    slots = backend.enable_lora(len(NAMES), 64)
    for slot, name in enumerate(NAMES):
        slots.load(slot, load_adapter(name, adapters[name], backend.config.model, 64))
    return backend


@pytest.fixture(scope="module")
def prompts(hf_model) -> list[list[int]]:
    return random_prompts(hf_model.config.vocab_size, LENGTHS, seed=7)


@pytest.fixture(scope="module")
def references(hf_model, adapters, prompts) -> list[tuple[np.ndarray, np.ndarray]]:
    """(HF + PEFT, HF) float32 logits of each chunk."""
    models = {name: with_lora(hf_model, adapters[name]) for name in NAMES}
    return [
        (hf_logits(hf_model if slot is None else models[NAMES[slot]], prompt), hf_logits(hf_model, prompt))
        for prompt, slot in zip(prompts, SLOTS, strict=True)
    ]


def run(backend, prompts: list[list[int]], slots: list[int | None]) -> list[np.ndarray]:
    """Every prompt's logits from one step, a chunk per prompt under its slot."""
    chunks = [
        SequenceChunk(prompt, 0, list(range(4 * i, 4 * i + 4)), len(prompt), lora_slot=slot)
        for i, (prompt, slot) in enumerate(zip(prompts, slots, strict=True))
    ]
    return np.split(backend.step(chunks), np.cumsum(LENGTHS)[:-1])


def failures(got, got_base, references) -> dict[int, str]:
    """The chunks outside the bounds (the docstring's), by index, with their numbers."""
    out = {}
    for i, (lora, base, (ref, ref_base)) in enumerate(zip(got, got_base, references, strict=True)):
        error, base_error = np.abs(lora - ref).max(), np.abs(base - ref_base).max()
        effect = np.abs(ref - ref_base).max()
        effect_error = np.abs((lora - base) - (ref - ref_base)).max()
        if error > LORA_ERROR * base_error or effect_error > DELTA_ERROR * effect:
            out[i] = f"error {error:.3f} (base {base_error:.3f}), effect {effect:.2f} off by {effect_error:.3f}"
    return out


@pytest.fixture(scope="module")
def base_logits(backend, prompts) -> list[np.ndarray]:
    return run(backend, prompts, [None] * len(prompts))


def test_a_mixed_step_matches_hf_peft_per_slot_within_int8s_bound(backend, prompts, references, base_logits):
    got = run(backend, prompts, SLOTS)
    assert failures(got, base_logits, references) == {}
    for lora, base, slot in zip(got, base_logits, SLOTS, strict=True):
        if slot is None:  # rows never see each other: a base chunk beside adapters is the base step's, exactly
            np.testing.assert_array_equal(lora, base)
        else:
            assert np.abs(lora - base).max() > 1.0, NAMES[slot]  # each adapter changes its chunk


def test_a_step_without_adapter_tokens_runs_the_base_path(backend, prompts, base_logits, monkeypatch):
    def refuse(*args: object) -> None:
        raise AssertionError("a base-only step computed LoRA updates")

    monkeypatch.setattr("executors.cpu_int8.StepLora", refuse)
    np.testing.assert_array_equal(
        np.concatenate(run(backend, prompts, [None] * len(prompts))), np.concatenate(base_logits)
    )


def test_the_bounds_catch_a_missing_smoothing_correction(backend, prompts, references, base_logits, monkeypatch):
    """Without down's smoothing factors (up's update added in the real space, down's input left smoothed), the
    chunks of adapters of the MLP leave the bounds; the attention-only ones stay within them."""
    assert any((layer.s_down != 1).any() for layer in backend.layers)
    ones = [dataclasses.replace(layer, s_down=np.ones_like(layer.s_down)) for layer in backend.layers]
    monkeypatch.setattr(backend, "layers", ones)
    broken = failures(run(backend, prompts, SLOTS), base_logits, references)
    mlp_chunks = [i for i, slot in enumerate(SLOTS) if slot is not None and NAMES[slot] in ("mlp-rs", "all")]
    assert list(broken) == mlp_chunks


def test_the_bounds_catch_a_swapped_slot(backend, prompts, references, base_logits):
    swapped = [None if slot is None else (slot + 1) % len(NAMES) for slot in SLOTS]
    broken = failures(run(backend, prompts, swapped), base_logits, references)
    assert list(broken) == [i for i, slot in enumerate(SLOTS) if slot is not None]


def test_greedy_through_the_engine(engine, adapters):
    """An adapter of every projection and the base model in one batch through LLM(backend="cpu-int8")."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, lora=name) for name in (None, "all", "qv")]
    modules = {name: str(adapters[name]) for name in ("all", "qv")}
    with LLM(engine, backend="cpu-int8", lora_modules=modules, max_loras=2) as llm:
        base, full, qv = llm.generate([[5, 6, 7, 8, 9]] * 3, params)
        stats = llm.engine.stats().lora
    assert len(base.token_ids) == len(full.token_ids) == len(qv.token_ids) == 10
    assert full.token_ids != base.token_ids and qv.token_ids != base.token_ids
    assert stats is not None and stats.requests == {"all": 1, "qv": 1}

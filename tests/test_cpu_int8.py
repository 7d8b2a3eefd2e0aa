"""The cpu-int8 backend (int8 dense layers in our kernel, our attention kernel, no ONNX Runtime or torch) on every
tiny architecture, the build's verification and quality gate of it, and when it is the CPU default.

Tolerance: W8A8 rounds every weight to 1/254 of its channel's range and every activation to 1/255 of its
token's, so logits move by a few percent of the largest (measured on the tiny models: 2.4-5.8%, logits up to
~5). The bound is the build's (builder/verify.py INT8_VERIFY_TOLERANCE, 10%); a fault (a wrong block table,
position or pool slot) moves logits by more, which `test_a_wrong_block_table_is_caught` shows. Quality is the
gate's to judge (perplexity, KL, top-1, answers), not this bound's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import builder.verify
import executors.factory
from builder.verify import INT8_VERIFY_TOLERANCE, verify_engine
from engine_format import EngineConfig, EngineLoadError
from engine_format.config import verified_backends
from engine_format.files import ACTIVATION_RANGES_FILE
from executors import create_backend, default_backend
from executors.base import SequenceChunk
from executors.cpus import int8_simd
from tests.helpers import NEEDS_BF16_MATMUL, hf_logits, random_prompts


@pytest.fixture(scope="module")
def backend(tiny_engine):
    return create_backend(EngineConfig.load(tiny_engine), num_blocks=64, kind="cpu-int8")


@pytest.fixture(scope="module")
def reference(tiny_hf):
    """(a 43-token random prompt, HF float32 logits, the bound) per vocabulary size."""
    model, _ = tiny_hf
    cache: dict[int, tuple[list[int], np.ndarray, float]] = {}

    def get(vocab: int) -> tuple[list[int], np.ndarray, float]:
        if vocab not in cache:
            tokens = random_prompts(vocab, [43])[0]
            ref = hf_logits(model, tokens)
            cache[vocab] = (tokens, ref, INT8_VERIFY_TOLERANCE * float(np.abs(ref).max()))
        return cache[vocab]

    return get


def error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max())


def test_prefill_then_decodes_within_w8a8s_bound(backend, reference):
    tokens, ref, bound = reference(backend.config.model.vocab_size)
    table = list(range(6))
    got = [backend.step([SequenceChunk(tokens[:40], 0, table)])[0]]
    got += [backend.step([SequenceChunk([tokens[p]], p, table)])[0] for p in range(40, 43)]  # read the pool
    assert error(np.stack(got), ref[39:43]) <= bound
    assert error(np.stack(got), ref[39:43]) > 1e-3 * bound  # it really ran in int8 (float32 is ~1e-6 away)


def test_prompt_logits_every_row(backend, reference):
    tokens, ref, bound = reference(backend.config.model.vocab_size)
    got = backend.prompt_logits(SequenceChunk(tokens, 0, list(range(10, 16))))
    assert got.shape == ref.shape and error(got, ref) <= bound


def test_ragged_batch_equals_single_sequences_bit_for_bit(backend):
    """Rows never see each other: activations are quantized per token and each row's int32 sums are exact,
    so a decode, a prefill chunk and a verify chunk (3 logit rows) batched give exactly their logits alone."""
    vocab = backend.config.model.vocab_size
    a, b, c = random_prompts(vocab, [20, 13, 30], seed=7)
    backend.step([SequenceChunk(a[:19], 0, [20, 21, 22])])
    backend.step([SequenceChunk(c[:24], 0, [30, 31, 32, 33])])
    chunks = [SequenceChunk(a[19:], 19, [20, 21, 22]), SequenceChunk(b, 0, [40, 41]),
              SequenceChunk(c[24:], 24, [30, 31, 32, 33], num_logits=3)]  # fmt: skip
    batched = backend.step(chunks)
    alone = np.concatenate([backend.step([chunk]) for chunk in chunks])
    assert batched.shape == (5, vocab)
    np.testing.assert_array_equal(batched, alone)


def test_a_wrong_block_table_is_caught(backend, reference):
    """The bound can fail: decoding over another sequence's blocks is far outside it."""
    tokens, ref, bound = reference(backend.config.model.vocab_size)
    backend.step([SequenceChunk(tokens[:42], 0, list(range(6)))])
    right = backend.step([SequenceChunk([tokens[42]], 42, list(range(6)))])[0]
    wrong = backend.step([SequenceChunk([tokens[42]], 42, [6, 7, 8, 9, 10, 5])])[0]
    assert error(right, ref[42]) <= bound < error(wrong, ref[42])


def test_refuses_engines_with_their_own_numerics(llama_engine):
    config = EngineConfig.load(llama_engine)
    for changed in (
        dataclasses.replace(config, quantization="int4-awq"),
        dataclasses.replace(config, dtype="bfloat16"),
    ):
        with pytest.raises(EngineLoadError, match="cpu-int8 backend quantizes a float32 engine"):
            create_backend(changed, num_blocks=8, kind="cpu-int8")


@pytest.fixture(scope="module")
def hf_model():
    from builder.sources import load_checkpoint, resolve_model

    return load_checkpoint(resolve_model("tiny-llama"))[0]


@NEEDS_BF16_MATMUL  # (its last check verifies on cpu-bf16)
def test_on_vnni_a_float32_engine_is_verified_on_cpu_int8_at_its_bound(llama_engine, hf_model, monkeypatch):
    monkeypatch.setattr(builder.verify, "int8_simd", lambda: True)
    monkeypatch.setattr(builder.verify, "amx_bf16", lambda: False)
    record = verify_engine(EngineConfig.load(llama_engine), hf_model)
    backends = record["backends"]
    assert list(backends) == ["graph", "plugin", "cpu", "cpu-int8"]
    assert backends["cpu-int8"]["tolerance"] == pytest.approx(INT8_VERIFY_TOLERANCE * record["max_abs_logit"])
    assert max(backends["cpu-int8"]["max_abs_error"].values()) > 100 * max(backends["cpu"]["max_abs_error"].values())
    monkeypatch.setattr(builder.verify, "amx_bf16", lambda: True)  # where cpu-bf16 is the default: not int8
    assert "cpu-int8" not in verify_engine(EngineConfig.load(llama_engine), hf_model)["backends"]


@pytest.mark.skipif(not int8_simd(), reason="this CPU has no AVX512-VNNI: builds do not gate cpu-int8")
def test_the_build_gates_cpu_int8_and_records_it(llama_engine):
    import json

    manifest = json.loads((llama_engine / "manifest.json").read_text())
    gate = manifest["verification"]["backends"]["cpu-int8"]["gate"]
    assert gate["method"] == "cpu-int8" and set(gate["checks"]) == {
        "perplexity_increase", "mean_kl", "top1_agreement", "answer_retention",
    }  # fmt: skip
    assert gate["passed"] == all(check["passed"] for check in gate["checks"].values())
    assert "answers" not in gate["metrics"]  # the texts stay out of the manifest
    config = EngineConfig.load(llama_engine)
    with np.load(llama_engine / ACTIVATION_RANGES_FILE) as ranges:  # what smooths the backend's quantization
        spec = config.model
        want = {f"layer{i}.{m}" for i in range(spec.num_layers) for m in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj")} | {"lm_head"}  # fmt: skip
        assert set(ranges.files) == want
        assert ranges["layer0.down_proj"].shape == (spec.intermediate_size,)
        assert (ranges["lm_head"] > 0).all() and ranges["lm_head"].shape == (spec.hidden_size,)


def test_an_engine_without_ranges_runs_unsmoothed_and_a_damaged_file_is_refused(llama_engine, tmp_path):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(llama_engine, copy)
    (copy / ACTIVATION_RANGES_FILE).unlink(missing_ok=True)
    config = EngineConfig.load(copy)
    plain = create_backend(config, num_blocks=8, kind="cpu-int8")
    assert all(layer.o_proj_multiplier is None for layer in plain.layers)
    tokens = random_prompts(config.model.vocab_size, [12])[0]
    assert plain.step([SequenceChunk(tokens, 0, [0, 1])]).shape == (1, config.model.vocab_size)
    (copy / ACTIVATION_RANGES_FILE).write_bytes(b"not an npz")
    with pytest.raises(EngineLoadError, match=r"activation_ranges\.npz could not be read"):
        create_backend(config, num_blocks=8, kind="cpu-int8")


def test_a_failed_gate_keeps_the_backend_out_of_the_verified_ones():
    record = {"max_abs_error": {"decode": 1.0}, "tolerance": 2.0}
    manifest = {"verification": {"backends": {
        "cpu": record, "cpu-int8": {**record, "gate": {"passed": False}}, "cpu-bf16": record,
    }}}  # fmt: skip
    assert verified_backends(manifest) == ("cpu", "cpu-bf16")
    manifest["verification"]["backends"]["cpu-int8"]["gate"]["passed"] = True
    assert verified_backends(manifest) == ("cpu", "cpu-int8", "cpu-bf16")


@pytest.mark.parametrize(
    ("vnni", "amx", "verified", "kv_cache_dtype", "want"),
    [
        (True, False, ("graph", "plugin", "cpu", "cpu-int8"), "auto", "cpu-int8"),
        (False, False, ("graph", "plugin", "cpu", "cpu-int8"), "auto", "cpu"),  # served on a CPU without VNNI
        (True, False, ("graph", "plugin", "cpu"), "auto", "cpu"),  # its gate failed, or built before it
        (True, True, ("graph", "plugin", "cpu", "cpu-bf16", "cpu-int8"), "auto", "cpu-bf16"),  # AMX first
        (True, False, ("graph", "plugin", "cpu", "cpu-int8"), "int8", "cpu"),  # a quantized pool: where its gate ran
    ],
)
def test_default_backend(llama_engine, monkeypatch, vnni, amx, verified, kv_cache_dtype, want):
    monkeypatch.setattr(executors.factory, "cuda_present", lambda: False)
    monkeypatch.setattr(executors.factory, "int8_simd", lambda: vnni)
    monkeypatch.setattr(executors.factory, "amx_bf16", lambda: amx)
    config = dataclasses.replace(
        EngineConfig.load(llama_engine), verified_backends=verified, kv_cache_dtype=kv_cache_dtype
    )
    assert default_backend(config) == want

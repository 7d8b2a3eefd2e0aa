"""Engines with a quantized KV cache (build-engine --kv-cache-dtype int8|fp8) on tiny random-weight
models: the manifest, the pool writes, the backends that refuse, capacity, and the engine loop
(prefix caching, preemption, abort) behaving exactly as with a float32 pool."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from builder.build import BuildOptions, build_engine
from builder.errors import BuildError
from calibration.data import DataConfig
from engine_format import EngineConfig, EngineLoadError, ModelSpec
from engine_format.files import GATE_REPORT_JSON, MANIFEST
from engine_format.kv_cache import bytes_per_token
from executors import create_backend
from executors.base import SequenceChunk
from executors.greedy import greedy_generate
from executors.kv_pool import blocks_for_budget, capacity_line
from executors.kv_quant import decode_fp8, dequantize_int8
from runtime import EngineArgs, LLMEngine, SamplingParams
from tests.conftest import TINY_BLOCK_SIZE, TINY_MAX_SEQ_LEN
from tests.helpers import random_prompts, run_with_arrivals
from tests.test_llm_engine import greedy_ignoring_eos, shared_prefix_prompts

SMALL_DATA = DataConfig(calibration_samples=8, heldout_samples=4, seq_len=64)
LOOSE = {"max_perplexity_increase": 10.0, "max_mean_kl": 10.0, "min_top1_agreement": 0.0, "min_answer_retention": 0.0}


def _gate(root: Path, thresholds: dict) -> Path:
    """Tiny random models predict near-uniformly: their gate numbers mean nothing, so the builds here
    use a permissive gate (the mechanics), and one strict gate that must fail."""
    path = root / f"gate-{len(list(root.glob('gate-*')))}.json"
    path.write_text(json.dumps({"version": 0, "thresholds": dict.fromkeys(("kv-int8", "kv-fp8"), thresholds)}))
    return path


def _build(out: Path, kv: str, gate: Path, **extra) -> dict:
    return build_engine(BuildOptions(
        model="tiny-llama", output=out, max_batch_size=8, max_seq_len=TINY_MAX_SEQ_LEN, block_size=TINY_BLOCK_SIZE,
        kv_cache_dtype=kv, calibration=SMALL_DATA, gate_config=gate, **extra,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def kv_engines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv_quant")
    gate = _gate(root, LOOSE)
    engines = {}
    for kv in ("int8", "fp8"):
        engines[kv] = root / f"tiny-llama-kv-{kv}"
        _build(engines[kv], kv, gate)
    return engines


def test_manifest_records_the_kv_dtype_scales_and_gate(kv_engines):
    for kv, engine in kv_engines.items():
        manifest = json.loads((engine / MANIFEST).read_text())
        config = EngineConfig.load(engine)
        assert config.kv_cache_dtype == kv and manifest["kv_cache"]["dtype"] == kv
        assert manifest["kv_cache"]["gate"]["passed"] and manifest["kv_cache"]["calibration_data"]["heldout_sha256"]
        report = json.loads((engine / GATE_REPORT_JSON).read_text())
        assert report["kv_cache_dtype"] == kv and report["method"] == f"kv-{kv}"
        assert f"(KV cache {kv})" in (engine / "gate_report.md").read_text()
        assert manifest["kv_layout"]["bytes_per_token"] == bytes_per_token(config.model, "float32", kv)
        assert list(manifest["verification"]["backends"]) == ["graph", "plugin", "cpu"]
    fp8 = EngineConfig.load(kv_engines["fp8"])
    assert fp8.kv_scales is not None and len(fp8.kv_scales) == fp8.model.num_layers
    assert EngineConfig.load(kv_engines["int8"]).kv_scales is None


def test_an_engine_without_the_kv_field_loads_as_auto(llama_engine, tmp_path):
    """Engines built before KV quantization (same format version) keep loading."""
    copy = tmp_path / "old"
    shutil.copytree(llama_engine, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest.pop("kv_cache", None)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    config = EngineConfig.load(copy)
    assert config.kv_cache_dtype == "auto" and config.kv_pool_dtype == "float32" and not config.kv_quantized


@pytest.mark.parametrize(("edit", "message"), [
    (lambda kv: kv.update(dtype="int4"), "kv_cache.dtype 'int4' is not one of"),
    (lambda kv: kv.pop("scales"), "needs kv_cache.scales"),
    (lambda kv: kv.update(scales=[[0.0, 1.0]] * len(kv["scales"])), "must be positive"),
])  # fmt: skip
def test_a_bad_kv_section_is_refused(kv_engines, tmp_path, edit, message):
    copy = tmp_path / "bad"
    shutil.copytree(kv_engines["fp8"], copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    edit(manifest["kv_cache"])
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineLoadError, match=message):
        EngineConfig.load(copy)


def test_backends_that_cannot_read_a_quantized_pool_refuse_by_name(kv_engines):
    """TensorRT refuses (no plugin registers the quantized kernels); the torch backend reads the pool
    (tests/test_torch_kv_quant.py); the default stays the CPU kernel backend."""
    config = EngineConfig.load(kv_engines["int8"])
    with pytest.raises(EngineLoadError, match="the 'tensorrt' backend does not read a int8 KV cache"):
        create_backend(config, kind="tensorrt")
    assert type(create_backend(config)).__name__ == "OrtCpuBackend"  # the default picks the one that can


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_rows_are_quantized_in_place_where_the_float_engine_writes_them(kv_engines, llama_engine, kv):
    """Same prompt (a prefill chunk, a second chunk, a decode) through the float32-KV engine and the
    quantized one: layer 0's rows (from the embeddings alone) dequantize to the float pool's within
    the format's rounding step; deeper layers' drift only by what the quantized attention changed."""
    prompt = random_prompts(488, [29], seed=3)[0]
    float_backend = create_backend(EngineConfig.load(llama_engine), num_blocks=8, kind="cpu")
    config = EngineConfig.load(kv_engines[kv])
    backend = create_backend(config, num_blocks=8, kind="cpu")
    table = [5, 2, 7, 0]
    for b in (float_backend, backend):
        b.step([SequenceChunk(prompt[:20], 0, table), SequenceChunk(prompt[:3], 0, [1])])
        b.step([SequenceChunk(prompt[20:], 20, table), SequenceChunk(prompt[3:4], 3, [1])])
    slots = np.array([table[p // TINY_BLOCK_SIZE] * TINY_BLOCK_SIZE + p % TINY_BLOCK_SIZE for p in range(29)])
    shape = float_backend.pool.shape
    want = float_backend.pool.reshape(*shape[:2], -1, shape[-1])[:, :, slots]
    codes = backend.pool.reshape(*shape[:2], -1, shape[-1])[:, :, slots]
    if kv == "int8":
        scales = backend.kv.scales.reshape(*shape[:2], -1, config.model.num_kv_heads)[:, :, slots]
        got, bound = dequantize_int8(codes, scales), np.repeat(scales, config.model.head_dim, -1) / 2
    else:
        layer = np.array(config.kv_scales, np.float32)[:, :, None, None]
        got = decode_fp8(codes) * layer
        bound = np.maximum(np.abs(want) * 2.0**-4, 2.0**-10 * layer)  # half an ulp (3 mantissa bits), subnormals
    assert np.all(np.abs(got - want)[0] <= bound[0] * 1.01 + 1e-6)
    assert np.abs(got - want)[0].max() > 0  # really quantized
    assert np.abs(got - want).max() < 0.2 * np.abs(want).max()  # measured 0.09 (fp8) on this random model


def test_capacity_at_the_same_memory_budget():
    """SmolLM2-135M shapes (30 layers, 3 kv heads of 64): int8 with float32 scales per (token, kv head)
    takes 68 bytes per head-row against fp32's 256, 3.76x the tokens; fp8 (layer scales) exactly 4x."""
    spec = ModelSpec("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, True, False, "default", 8192,
                     (None,) * 30, 1, (2,))  # fmt: skip
    config = EngineConfig(Path("."), "onnxruntime-cpu", "float32", 64, 32, 2048, spec)
    budget = 2**30
    blocks = {kv: blocks_for_budget(dataclasses.replace(config, kv_cache_dtype=kv), budget) for kv in ("auto", "int8")}
    assert bytes_per_token(spec, "float32", "auto") == 46080 and bytes_per_token(spec, "float32", "int8") == 12240
    assert blocks == {"auto": 364, "int8": 1370}
    assert 3.7 < blocks["int8"] / blocks["auto"] < 3.8
    assert bytes_per_token(spec, "float32", "auto") == 4 * bytes_per_token(spec, "float32", "fp8")
    line = capacity_line(dataclasses.replace(config, kv_cache_dtype="int8"), blocks["int8"])
    assert "int8" in line and "1370 blocks" in line and "max concurrency at max_seq_len 2048: 42.8" in line


def test_a_kv_dtype_that_fails_the_gate_fails_the_build(tmp_path, llama_engine):
    strict = _gate(tmp_path, {**LOOSE, "min_top1_agreement": 1.01})
    out = tmp_path / "never"
    with pytest.raises(BuildError, match="quality gate failed"):
        _build(out, "int8", strict)
    assert not out.exists()
    report = json.loads((tmp_path / "never.gate-failed.json").read_text())
    assert report["kv_cache_dtype"] == "int8" and report["method"] == "kv-int8" and not report["passed"]


def test_quantized_kv_needs_the_cpu_target_and_float32(tmp_path):
    with pytest.raises(BuildError, match="--kv-cache-dtype int8 is supported for --target onnxruntime-cpu"):
        _build(tmp_path / "x", "int8", tmp_path / "unused.json", target="tensorrt")


# ---- the engine loop with a quantized pool -------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def int8_reference(kv_engines):
    """Sequential greedy generation on the int8-KV backend, one prompt at a time."""
    backend = create_backend(EngineConfig.load(kv_engines["int8"]), kind="cpu")

    def run(prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> list[int]:
        return greedy_generate(backend, [prompt], max_tokens, (2,))[0]

    return run


def test_prefix_cache_on_and_off_identical_with_int8_kv(kv_engines):
    """Scales are per row, fixed when the row is written: a cached block reads back exactly what a
    recomputation would write, so prefix hits change nothing."""
    prompts = shared_prefix_prompts(488, 12)
    results = {}
    for caching in (True, False):
        engine = LLMEngine(kv_engines["int8"], EngineArgs(enable_prefix_caching=caching, max_num_batched_tokens=64))
        results[caching] = run_with_arrivals(engine, prompts, GREEDY, list(range(len(prompts))))
        assert (engine.stats().prefix_cache_hits > 0) == caching
    assert results[True] == results[False]


def test_preemption_storm_matches_sequential_with_int8_kv(kv_engines, int8_reference):
    engine = LLMEngine(kv_engines["int8"], EngineArgs(num_kv_blocks=12, max_num_batched_tokens=64))
    prompts = random_prompts(engine.config.model.vocab_size, [20, 25, 30, 18, 22, 27, 31, 19], seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = run_with_arrivals(engine, prompts, params, [0] * len(prompts))
    assert engine.stats().preemptions > 0
    assert [got[i] for i in range(len(prompts))] == [greedy_ignoring_eos(int8_reference, p, 16) for p in prompts]
    assert engine.kv.pool.counts()["used"] == 0


def test_abort_frees_blocks_at_once_with_int8_kv(kv_engines):
    engine = LLMEngine(kv_engines["int8"])
    keep = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    victim = engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    held, used = len(engine.requests[victim].block_ids), engine.kv.pool.counts()["used"]
    assert engine.abort(victim).finish_reason == "abort"
    assert engine.kv.pool.counts()["used"] == used - held
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.counts()["used"] == 0 and keep not in engine.requests

"""The CPU default for float32 engines (executors/factory.default_backend): cpu-bf16 where the CPU has AMX and
the build verified the engine on it at bfloat16's bound (builder/verify.py), `cpu` everywhere else."""

from __future__ import annotations

import dataclasses

import pytest

import builder.verify
import executors.factory
from builder.errors import BuildError
from builder.verify import VERIFY_TOLERANCE, verify_engine
from engine_format import EngineConfig, EngineLoadError
from executors import default_backend
from runtime import LLM, SamplingParams
from tests.helpers import NEEDS_BF16_MATMUL


@pytest.fixture(scope="module")
def hf_model():
    from builder.sources import load_checkpoint, resolve_model

    return load_checkpoint(resolve_model("tiny-llama"))[0]


@pytest.fixture
def on_cpu(monkeypatch):
    """default_backend as on a machine without a GPU (CI's), whatever this one has."""
    monkeypatch.setattr(executors.factory, "cuda_present", lambda: False)


@NEEDS_BF16_MATMUL
def test_on_amx_a_float32_engine_is_also_verified_on_cpu_bf16_at_bf16s_bound(llama_engine, hf_model, monkeypatch):
    monkeypatch.setattr(builder.verify, "amx_bf16", lambda: True)
    record = verify_engine(EngineConfig.load(llama_engine), hf_model)
    backends = record["backends"]
    assert list(backends) == ["graph", "plugin", "cpu", "cpu-bf16"]
    float32_bound = VERIFY_TOLERANCE["float32"] * record["max_abs_logit"]
    bf16_bound = max(0.03 * record["max_abs_logit"], 2 * record["hf_bfloat16_max_abs_error"])
    assert record["tolerance"] == pytest.approx(float32_bound)  # the engine's own backends keep float32's
    for kind in ("graph", "plugin", "cpu"):
        assert backends[kind]["tolerance"] == pytest.approx(float32_bound)
    assert backends["cpu-bf16"]["tolerance"] == pytest.approx(bf16_bound)
    for result in backends.values():
        assert max(result["max_abs_error"].values()) <= result["tolerance"]
    # it really ran in bfloat16: coarser than float32's bound, far coarser than the float32 backends
    assert max(backends["cpu-bf16"]["max_abs_error"].values()) > float32_bound
    assert max(backends["cpu-bf16"]["max_abs_error"].values()) > 100 * max(backends["cpu"]["max_abs_error"].values())


def test_without_amx_the_build_does_not_verify_cpu_bf16(llama_engine, hf_model, monkeypatch):
    monkeypatch.setattr(builder.verify, "amx_bf16", lambda: False)
    monkeypatch.setattr(builder.verify, "int8_simd", lambda: False)  # tests/test_cpu_int8.py
    record = verify_engine(EngineConfig.load(llama_engine), hf_model)
    assert list(record["backends"]) == ["graph", "plugin", "cpu"] and "hf_bfloat16_max_abs_error" not in record


@NEEDS_BF16_MATMUL
def test_the_bf16_bound_is_checked_on_cpu_bf16(llama_engine, hf_model, monkeypatch):
    """The check can fail: at float32's bound, cpu-bf16's bfloat16 arithmetic is refused, and the error names it."""
    monkeypatch.setattr(builder.verify, "amx_bf16", lambda: True)
    monkeypatch.setattr(builder.verify, "BF16_HEADROOM", 0.0)
    monkeypatch.setitem(VERIFY_TOLERANCE, "bfloat16", VERIFY_TOLERANCE["float32"])
    with pytest.raises(BuildError, match=r"verification failed \(cpu-bf16 backend\)"):
        verify_engine(EngineConfig.load(llama_engine), hf_model)


def test_the_manifest_lists_the_verified_backends(llama_engine):
    config = EngineConfig.load(llama_engine)
    assert {"graph", "plugin", "cpu"} <= set(config.verified_backends)


@pytest.mark.parametrize(
    ("amx", "verified", "kv_cache_dtype", "want"),
    [
        (True, ("graph", "plugin", "cpu", "cpu-bf16"), "auto", "cpu-bf16"),
        (False, ("graph", "plugin", "cpu", "cpu-bf16"), "auto", "cpu"),  # served on a CPU without AMX
        (True, ("graph", "plugin", "cpu"), "auto", "cpu"),  # built without AMX, or before the check
        (True, ("graph", "plugin", "cpu", "cpu-bf16"), "int8", "cpu"),  # a quantized pool: where its gate ran
    ],
)
def test_default_backend_for_a_float32_engine(llama_engine, on_cpu, monkeypatch, amx, verified, kv_cache_dtype, want):
    monkeypatch.setattr(executors.factory, "amx_bf16", lambda: amx)
    config = dataclasses.replace(
        EngineConfig.load(llama_engine), verified_backends=verified, kv_cache_dtype=kv_cache_dtype
    )
    assert default_backend(config) == want


def test_serving_defaults_to_cpu_bf16_on_amx_and_cpu_on_request(llama_engine, on_cpu, monkeypatch):
    if "cpu-bf16" not in EngineConfig.load(llama_engine).verified_backends:
        pytest.skip("this CPU has no AMX: the engine was not verified on cpu-bf16")
    monkeypatch.setattr(executors.factory, "amx_bf16", lambda: True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [[5, 6, 7, 8] * 5]
    default = LLM(llama_engine, max_num_batched_tokens=16)
    assert type(default.engine.backend).__name__ == "TorchCpuBackend"
    float32 = LLM(llama_engine, max_num_batched_tokens=16, backend="cpu")
    assert type(float32.engine.backend).__name__ == "OrtCpuBackend"
    assert len(default.generate(prompt, params)[0].token_ids) == 6 == len(float32.generate(prompt, params)[0].token_ids)


def test_without_onednn_bfloat16_the_backend_refuses_naming_the_cpu_and_the_way_out(llama_engine, monkeypatch):
    """An AVX2-only CPU: oneDNN would fail deep in the first matmul; the backend refuses at load instead."""
    import executors.torch_cpu

    monkeypatch.setattr(executors.torch_cpu, "bf16_matmul", lambda: False)
    with pytest.raises(EngineLoadError, match=r"AVX-512 \(BW, VL, DQ\) or AVX-NE-CONVERT.*use --backend cpu"):
        executors.factory.create_backend(EngineConfig.load(llama_engine), num_blocks=8, kind="cpu-bf16")

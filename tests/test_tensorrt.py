"""The TensorRT path on a machine without a GPU or TensorRT: clean refusals, lazy imports,
plugin PTX that assembles, the graph TensorRT would parse. GPU tests run with `pytest -m gpu`
on a GPU machine and are skipped here with the reason."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from builder.plugin_graph import DOMAIN
from builder.tensorrt_build import cuda_device_count, tensorrt_graph
from engine_format import EngineConfig, EngineLoadError, TensorRTLimits
from engine_format.files import MANIFEST, PLUGIN_GRAPH_FILE
from executors import create_backend
from executors.base import SequenceChunk
from executors.tensorrt import (
    ALIGN,
    STEP_INPUTS,
    ProfileContext,
    check_limits,
    input_capacity,
    pack_inputs,
    plan_calls,
)


def has_tensorrt_gpu() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return cuda_device_count() > 0


no_gpu = not has_tensorrt_gpu()
gpu = pytest.mark.gpu


def test_build_engine_tensorrt_refuses_in_one_line_and_keeps_output(tmp_path):
    if not no_gpu:
        pytest.skip("this machine has TensorRT and a GPU")
    from builder.cli import main

    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("existing engine")
    result = CliRunner().invoke(main, ["--model", "tiny-llama", "--output", str(out), "--backend", "tensorrt"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "TensorRT" in lines[0] and "Traceback" not in result.output, result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "existing engine"


def test_a_tensorrt_engine_gives_a_clear_load_error_here(llama_engine, tmp_path):
    if not no_gpu:
        pytest.skip("this machine has TensorRT and a GPU")
    engine = tmp_path / "engine"
    shutil.copytree(llama_engine, engine)
    manifest = json.loads((engine / MANIFEST).read_text())
    manifest["backend"] = "tensorrt"
    (engine / MANIFEST).write_text(json.dumps(manifest))
    config = EngineConfig.load(engine)
    with pytest.raises(EngineLoadError, match=r"tensorrt.*TensorRT"):
        create_backend(config)
    # the ONNX forms of the same engine still run on the CPU when asked for explicitly
    logits = create_backend(config, num_blocks=8, kind="plugin").step([SequenceChunk([5, 6, 7], 0, [0])])
    assert logits.shape == (1, config.model.vocab_size)


def test_trt_modules_import_without_tensorrt():
    modules = "plugins_cuda.trt_plugins, builder.tensorrt_build, executors.tensorrt"
    code = f"import sys, {modules}; print('tensorrt' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-2000:]


def test_tensorrt_graph_maps_plugin_nodes_and_drops_new_kv(llama_engine):
    plugin = onnx.load(llama_engine / PLUGIN_GRAPH_FILE, load_external_data=False)
    model = tensorrt_graph(plugin)
    graph = model.graph
    assert not model.functions and [o.name for o in graph.output] == ["logits"]
    nodes = [n for n in graph.node if n.domain == DOMAIN]
    assert len(nodes) == 4 * EngineConfig.load(llama_engine).model.num_layers  # prologue, write, attention, merge
    assert all(any(a.name == "aot" and a.i == 1 for a in n.attribute) for n in nodes)
    assert not any(n.name == "new_kv" for n in graph.node)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_plugin_ptx_drops_triton_hidden_params_and_assembles(tmp_path):
    """What TensorRT would receive from aot_impl assembles for sm_80; a wrong parameter count is refused."""
    script = (
        "from plugins_cuda import aot, kv_write, paged_attention\n"
        "k = kv_write.compile_for_arch(80, 'float16', 192, 64)\n"
        "open(r'%s', 'w').write(aot.plugin_ptx(k, 11))\n"
        "try:\n    aot.plugin_ptx(k, 10)\nexcept ValueError as e:\n    print('refused', e)\n"
    ) % (tmp_path / "kv_write.ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # other test modules set it
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "refused" in result.stdout, result.stderr[-2000:]
    ptx = (tmp_path / "kv_write.ptx").read_text()
    assert "_param_10" in ptx and "_param_11" not in ptx
    asm = subprocess.run(["ptxas", "-arch=sm_80", str(tmp_path / "kv_write.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert asm.returncode == 0, asm.stderr


def trt_config(llama_engine, **limits):
    config = EngineConfig.load(llama_engine)
    base = TensorRTLimits.from_build(config.max_batch_size, config.max_seq_len, config.block_size, max_step=64)
    return dataclasses.replace(config, target="tensorrt", tensorrt=dataclasses.replace(base, **limits))


def test_start_up_limits_are_checked_against_engine_args(llama_engine):
    """The run's sizes against the plan's profiles, with the fix in the message (no GPU needed)."""
    config = trt_config(llama_engine)  # max_batch 8, max_step 64, 32 table blocks, 256 pool blocks
    assert check_limits(config, None, None) == config.tensorrt
    assert check_limits(config, 256, 64) == config.tensorrt
    with pytest.raises(EngineLoadError, match=r"300 KV blocks exceed the 256 .*num_kv_blocks <= 256"):
        check_limits(config, 300, None)
    with pytest.raises(EngineLoadError, match=r"max_num_batched_tokens 512 allows 256-token .* at most 64"):
        check_limits(config, None, 512)  # the engine's default budget, chunks capped by max_seq_len 256
    with pytest.raises(EngineLoadError, match="table blocks; the plan takes 16"):
        check_limits(trt_config(llama_engine, max_table_blocks=16), None, None)
    with pytest.raises(EngineLoadError, match="no TensorRT limits"):
        check_limits(EngineConfig.load(llama_engine), None, None)


def test_step_shapes_outside_a_profile_are_refused_with_its_limits(llama_engine):
    limits = trt_config(llama_engine).tensorrt
    decodes = [SequenceChunk([5], 9, [0, 1]) for _ in range(3)]
    calls = plan_calls([*decodes, SequenceChunk(list(range(3, 40)), 0, list(range(5)))], 8, limits)
    assert [(c.profile, c.rows) for c in calls] == [(0, [0, 1, 2]), (1, [3])]
    with pytest.raises(ValueError, match=r"prefill call \[batch=1, step=65, table_blocks=9\] is outside optimization "
                                         r"profile 1: batch <= 8, step <= 64"):  # fmt: skip
        plan_calls([SequenceChunk(list(range(65)), 0, list(range(9)))], 8, limits)
    with pytest.raises(ValueError, match=r"decode call \[batch=9"):
        plan_calls([SequenceChunk([5], 0, [i]) for i in range(9)], 8, limits)


def test_inputs_of_both_calls_pack_into_one_aligned_buffer(llama_engine):
    limits = trt_config(llama_engine).tensorrt
    chunks = [SequenceChunk([5], 60, list(range(8))), SequenceChunk(list(range(3, 67)), 0, list(range(8, 16)))]
    calls = plan_calls(chunks, 8, limits)
    packed, layouts = pack_inputs(calls, STEP_INPUTS)
    for call, layout in zip(calls, layouts, strict=True):
        for name, (offset, shape) in layout.items():
            assert offset % ALIGN == 0
            want = getattr(call.tensors, name)
            np.testing.assert_array_equal(packed[offset : offset + want.size].reshape(shape), want)
    mixed = [SequenceChunk([1], 255, list(range(32)))] * 4 + [SequenceChunk([1] * 64, 192, list(range(32)))] * 4
    for step in (mixed, mixed[4:] * 2):  # the largest shapes the profiles take
        assert pack_inputs(plan_calls(step, 8, limits), STEP_INPUTS)[0].size <= input_capacity(limits)


class StandInContext:
    """The IExecutionContext calls the runner makes, answering False where told to."""

    def __init__(self, refuse: set[str]) -> None:
        self.refuse, self.shapes = refuse, {}

    def set_device_memory(self, memory: int, size: int) -> None:
        pass

    def set_optimization_profile_async(self, profile: int, stream: int) -> bool:
        return "profile" not in self.refuse

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        self.shapes[name] = shape
        return "shape" not in self.refuse

    def set_tensor_address(self, name: str, address: int) -> bool:
        return "address" not in self.refuse

    def execute_async_v3(self, stream: int) -> bool:
        return "execute" not in self.refuse


class StandInEngine:
    num_optimization_profiles = 2

    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse

    def create_execution_context(self, strategy: object) -> StandInContext | None:
        return None if "context" in self.refuse else StandInContext(self.refuse)

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple]:
        return [(1, 1), (4, 1), (8, 1)]


def test_every_tensorrt_call_is_checked_with_a_clear_error():
    trt = SimpleNamespace(ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED=2))
    make = lambda *refuse: ProfileContext(trt, StandInEngine(set(refuse)), 0, 0, 0, 0)  # noqa: E731
    ok = make()
    ok.set_shape("input_ids", (3, 1))
    ok.bind("input_ids", 256)
    ok.execute(0, {"input_ids": (3, 1)})
    with pytest.raises(EngineLoadError, match="could not create an execution context for profile 0"):
        make("context")
    with pytest.raises(EngineLoadError, match=r"refused optimization profile 0 \(the plan has 2"):
        make("profile")
    with pytest.raises(RuntimeError, match=r"rejected input_ids shape \(9, 1\) in optimization profile 0, which "
                                           r"accepts \(1, 1\) .. \(8, 1\)"):  # fmt: skip
        make("shape").set_shape("input_ids", (9, 1))
    with pytest.raises(RuntimeError, match="refused the address of logits"):
        make("address").bind("logits", 0)
    with pytest.raises(
        RuntimeError, match=r"execute_async_v3 failed in optimization profile 0 .inputs input_ids\(3, 1\)"
    ):
        make("execute").execute(0, {"input_ids": (3, 1)})


@gpu
@pytest.mark.skipif(no_gpu, reason="needs an NVIDIA GPU with TensorRT and torch (run with -m gpu there)")
def test_tensorrt_engine_matches_hf_eager(tmp_path):
    """Build a tiny TensorRT engine (head_dim 32: the fused prologue plugin refuses 16), then run a
    37-token prefill over three blocks and one decode step on its TensorRT backend and compare the
    logits with HF eager on the same checkpoint (tests/helpers.hf_logits): within the build's float32
    verification tolerance (VERIFY_TOLERANCE, relative to the largest reference logit). Then both
    calls in one step, sampled on the device, against the numpy sampler on the returned logits."""
    from builder.build import BuildOptions, build_engine
    from builder.sources import load_checkpoint, resolve_model
    from builder.verify import VERIFY_TOLERANCE
    from executors.sampling import Sampler, SamplingParams, SamplingState
    from tests.helpers import hf_logits
    from tests.test_torch_backend import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "checkpoint")
    options = BuildOptions(str(checkpoint), tmp_path / "trt", max_batch_size=4, max_seq_len=256, block_size=16,
                           target="tensorrt")  # fmt: skip
    build_engine(options)
    config = EngineConfig.load(options.output)
    model, _ = load_checkpoint(resolve_model(options.model))
    prompt, next_token = list(range(3, 40)), 41
    ref = hf_logits(model, [*prompt, next_token])  # [38, vocab]: row i predicts token i + 1
    atol = VERIFY_TOLERANCE[options.dtype] * float(np.abs(ref).max())
    backend = create_backend(config, num_blocks=16, kind="tensorrt")
    table = [0, 1, 2]
    steps = {
        "prefill": (SequenceChunk(prompt, 0, table), ref[len(prompt) - 1]),
        "decode": (SequenceChunk([next_token], len(prompt), table), ref[len(prompt)]),
    }
    for name, (chunk, want) in steps.items():
        (got,) = backend.step([chunk])
        np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=name)
    both = [SequenceChunk([next_token], len(prompt), table), SequenceChunk(prompt[:20], 0, [5, 6])]
    logits = backend.step(both)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, logprobs=2)
    rows = [SamplingState(params, prompt, config.model.vocab_size) for _ in both]
    sampled = backend.step_sample(both, rows)
    want = Sampler().sample(logits, [SamplingState(params, prompt, config.model.vocab_size) for _ in both])
    assert sampled.token_ids.tolist() == want.token_ids.tolist()
    backend.close()

"""The TensorRT path on a machine without a GPU or TensorRT: clean refusals, lazy imports,
plugin PTX that assembles, the graph TensorRT would parse. GPU tests run with `pytest -m gpu`
on a GPU machine and are skipped here with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import onnx
import pytest
from click.testing import CliRunner

from builder.plugin_graph import DOMAIN
from builder.tensorrt_build import cuda_device_count, tensorrt_graph
from engine_format import EngineConfig, EngineLoadError
from engine_format.files import MANIFEST, PLUGIN_GRAPH_FILE
from runtime.backends import create_backend
from runtime.backends.base import SequenceChunk


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
    modules = "plugins_cuda.trt_plugins, builder.tensorrt_build, runtime.backends.tensorrt"
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


@gpu
@pytest.mark.skipif(no_gpu, reason="needs an NVIDIA GPU with TensorRT and cuda-python (run with -m gpu there)")
def test_tensorrt_engine_matches_hf_eager(tmp_path):
    """Build a tiny TensorRT engine, then run a 37-token prefill over three blocks and one
    decode step on its TensorRT backend and compare the logits with HF eager on the same
    checkpoint (tests/helpers.hf_logits): within the build's float32 verification tolerance
    (VERIFY_TOLERANCE, relative to the largest reference logit)."""
    import numpy as np

    from builder.build import VERIFY_TOLERANCE, BuildOptions, build_engine
    from builder.sources import load_checkpoint, resolve_model
    from tests.helpers import hf_logits

    options = BuildOptions("tiny-llama", tmp_path / "trt", max_batch_size=4, max_seq_len=256, block_size=16,
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

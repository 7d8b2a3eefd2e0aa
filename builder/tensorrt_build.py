"""TensorRT compile of the plugin graph (GPU only): `build-engine --backend tensorrt`.

`require_tensorrt()` runs before anything else in the build, so a machine without TensorRT
or a GPU fails at once with one line and leaves --output untouched (tested on CPU). The rest
is UNVERIFIED (never run, no GPU here), written against the TensorRT 10.x Python API:
- graph: `model.plugins.onnx` with the reference functions stripped (the parser must map each
  `trtserve` node to its plugin, not inline a body), `aot=1` on every plugin node (embed the
  AOT kernels), and without the `new_kv` output (PagedKVWrite already wrote the pool);
- strongly typed network (the graph's dtypes are the engine's; no precision flags), aliased
  plugin I/O preview feature, two optimization profiles (decode: step 1; prefill chunks:
  step up to `max_step`), a timing cache kept across builds;
- `model.plan` plus the manifest's `tensorrt` section, read by executors/tensorrt.py.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from builder.errors import BuildError
from builder.plugin_graph import DOMAIN, strip_reference_functions
from engine_format import EngineConfig, TensorRTLimits
from engine_format.files import PLAN_FILE, PLUGIN_GRAPH_FILE, TRT_GRAPH_FILE

TIMING_CACHE = Path.home() / ".cache" / "trtserve" / "tensorrt-timing.cache"
GPU_EXTRA = "pip install 'trtserve[gpu]'"


def require_tensorrt() -> None:
    """BuildError (one line) unless TensorRT and cuda-python import and a CUDA GPU is visible."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise BuildError(
            f"--backend tensorrt needs TensorRT and an NVIDIA GPU; TensorRT is not installed ({GPU_EXTRA})"
        ) from None
    if cuda_device_count() < 1:
        raise BuildError("--backend tensorrt needs an NVIDIA GPU; TensorRT is installed but no CUDA device is visible")


def cuda_device_count() -> int:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return 0
    err, count = cudart.cudaGetDeviceCount()
    return int(count) if err == cudart.cudaError_t.cudaSuccess else 0


def profiles(limits: TensorRTLimits) -> list[dict[str, tuple[tuple[int, ...], ...]]]:
    """Per profile: input name prefix -> (min, opt, max) shapes, KV width and block size left as -1."""
    b, m, n = limits.max_batch, limits.max_table_blocks, limits.max_num_blocks
    out = []
    for steps in ((1, 1, 1), (1, min(128, limits.max_step), limits.max_step)):  # decode, prefill chunks
        batch = (1, b, b) if steps[2] == 1 else (1, 1, b)
        out.append({
            "input_ids": tuple((bb, s) for bb, s in zip(batch, steps, strict=True)),
            "positions": tuple((bb, s) for bb, s in zip(batch, steps, strict=True)),
            "seq_lens": tuple((bb,) for bb in batch), "past_lens": tuple((bb,) for bb in batch),
            "block_tables": tuple((bb, t) for bb, t in zip(batch, (1, m, m), strict=True)),
            "logit_rows": ((1,), (batch[1],), (b if steps[2] == 1 else limits.max_logit_rows,)),
            "key_cache": ((1, -1, -1), (n, -1, -1), (n, -1, -1)),
            "value_cache": ((1, -1, -1), (n, -1, -1), (n, -1, -1)),
        })  # fmt: skip
    return out


def tensorrt_graph(plugin_model: onnx.ModelProto) -> onnx.ModelProto:
    """The plugin graph as TensorRT parses it: no function bodies, AOT plugins, no new_kv."""
    model = strip_reference_functions(plugin_model)
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.attribute.append(helper.make_attribute("aot", 1))
    outputs = [o for o in model.graph.output if o.name != "new_kv"]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    live = {o.name for o in model.graph.output}
    kept = []
    for node in reversed(model.graph.node):  # drop the new_kv Unsqueeze/Concat chain
        if any(out in live for out in node.output):
            kept.append(node)
            live.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(kept))
    return model


def build_plan(engine_dir: Path, config: EngineConfig) -> dict:
    """Compile engine_dir/model.plugins.onnx into engine_dir/model.plan; returns the manifest's
    `tensorrt` fields beyond the limits (config.tensorrt, which the format writes)."""
    import tensorrt as trt

    from plugins_cuda.trt_plugins import register_plugins

    register_plugins()
    graph = tensorrt_graph(onnx.load(engine_dir / PLUGIN_GRAPH_FILE, load_external_data=False))
    onnx.save_model(graph, engine_dir / TRT_GRAPH_FILE)  # next to model.onnx.data, which it references
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(engine_dir / TRT_GRAPH_FILE)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {TRT_GRAPH_FILE}: {errors}")
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    assert config.tensorrt is not None, "a tensorrt target has limits"
    block_size, kv_width = config.block_size, config.model.kv_width
    for shapes in profiles(config.tensorrt):
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            ranges = shapes[name.split(".")[0]]
            fixed = [tuple(block_size if d == -1 and k == 1 else kv_width if d == -1 else d for k, d in enumerate(s))
                     for s in ranges]  # fmt: skip
            profile.set_shape(name, *fixed)
        config.add_optimization_profile(profile)
    TIMING_CACHE.parent.mkdir(parents=True, exist_ok=True)
    cache = config.create_timing_cache(TIMING_CACHE.read_bytes() if TIMING_CACHE.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError("TensorRT failed to build the engine (see the TensorRT log above)")
    (engine_dir / PLAN_FILE).write_bytes(bytes(plan))
    TIMING_CACHE.write_bytes(bytes(config.get_timing_cache().serialize()))
    return {
        "plan": PLAN_FILE, "graph": TRT_GRAPH_FILE, "tensorrt_version": trt.__version__,
        "profiles": ["decode", "prefill"],
    }  # fmt: skip

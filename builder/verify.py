"""Verification of a freshly built engine against HF eager, on every CPU backend that runs it.

One prompt goes through each backend as a one-shot prefill, then a decode step, then again in two
chunks over other blocks of the paged pool; every logit row must match HF eager's within a tolerance
relative to the largest |logit|. A build whose engine fails is not written.

bfloat16 engines: ONNX Runtime has no bfloat16 MatMul on CPUs, so their graphs (`model.onnx`, the
plugin graph TensorRT compiles) run as a float32 view, the same graph over the same bf16-rounded
weights with every bf16 type widened (`float32_view`), and the cpu-bf16 backend runs the engine in
bfloat16 itself. Their bound is HF's own bfloat16 forward: no further from float32 HF than
BF16_HEADROOM times HF-bfloat16's distance. float32 engines built on a CPU with AMX are also verified on
cpu-bf16, the default there (executors/factory.py), at that bound; built on a CPU with AVX512-VNNI or AVX2,
on cpu-int8 (int8 dense layers) at W8A8's bound, and then judged by the quality gate (builder/build.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper

from builder.errors import BuildError
from engine_format import EngineConfig, ceil_div
from engine_format.files import GRAPH_FILE, PLUGIN_GRAPH_FILE
from executors import create_backend
from executors.base import EngineBackend, SequenceChunk
from executors.cpus import amx_bf16, int8_simd

# Max |logit difference| between the engine and HF eager on the verification prompt, as a
# fraction of the largest |logit|. fp32 differs only in summation order (measured ~1e-6 on
# tiny models, ~1e-5 on SmolLM2); 1e-3 still catches any wrong op, weight or mask.
VERIFY_TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 3e-2}
# bfloat16 keeps 8 bits of mantissa: no fixed fraction fits every model, so the bound is also
# at least this many times HF eager's own bfloat16 error on the same prompt.
BF16_HEADROOM = 2.0

# Quantized engines are verified against the HF model with the same quantized weights
# (fake-quantized in torch); what remains is ORT's arithmetic: MatMulNBits computes INT4
# GEMMs with int8-quantized activations, and FP8 engines quantize activations per tensor.
QUANTIZED_VERIFY_TOLERANCE = {"int4-awq": 5e-2, "int4-rtn": 5e-2, "fp8": 1e-1}
# cpu-int8 quantizes weights per channel and activations per token (W8A8) as it loads a float32 engine: like
# FP8 engines, an error bound that catches a wrong op or weight; its quality is judged by the gate.
INT8_VERIFY_TOLERANCE = 1e-1
# A quantized KV cache adds its rounding to every attention read (the HF reference keeps fp32 K/V);
# its quality is judged by the gate, verification only catches a wrong pool or kernel.
KV_VERIFY_TOLERANCE = {"int8": 3e-2, "fp8": 1e-1}


def verify_engine(config: EngineConfig, model) -> dict:
    """Compare the engine with the HF model (float32; for a quantized build, the HF model holding the
    same quantized weights, see calibration.quantize). Raises BuildError when any backend differs by
    more than its tolerance; returns the record the manifest keeps (its backends are the engine's
    `verified_backends`)."""
    import torch

    spec = config.model
    prompt_len = min(config.max_seq_len - 1, config.block_size + 7)
    tokens = np.random.default_rng(0).integers(3, spec.vocab_size, prompt_len + 1).tolist()
    with torch.no_grad():
        ref_logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    want = {"prefill": ref_logits[-2], "chunked_prefill": ref_logits[-2], "decode": ref_logits[-1]}
    scale = float(np.abs(ref_logits).max())
    tolerance = max(QUANTIZED_VERIFY_TOLERANCE.get(config.quantization or "", 0.0), VERIFY_TOLERANCE[config.dtype],
                    KV_VERIFY_TOLERANCE.get(config.kv_cache_dtype, 0.0)) * scale  # fmt: skip
    result: dict = {"prompt_tokens": prompt_len, "max_abs_logit": scale, "backends": {}}
    bf16_tolerance = tolerance
    if config.dtype == "bfloat16" or _runs_bf16(config):
        with torch.no_grad():
            ref16 = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor([tokens])).logits[0, -2:].float().numpy()
        hf_bf16_error = float(np.abs(ref16 - ref_logits[-2:]).max())
        bf16_tolerance = max(VERIFY_TOLERANCE["bfloat16"] * scale, BF16_HEADROOM * hf_bf16_error)
        result["hf_bfloat16_max_abs_error"] = hf_bf16_error
    if config.dtype == "bfloat16":
        tolerance = bf16_tolerance
    result["tolerance"] = tolerance
    with tempfile.TemporaryDirectory() as scratch:
        for kind, backend in _backends(config, ceil_div(prompt_len + 1, config.block_size), Path(scratch)):
            bound = {"cpu-bf16": bf16_tolerance, "cpu-int8": INT8_VERIFY_TOLERANCE * scale}.get(kind, tolerance)
            got = _run(backend, tokens, config.block_size)
            errors = {k: float(np.abs(got[k] - want[k]).max()) for k in got}
            result["backends"][kind] = {
                "max_abs_error": errors,
                "argmax_equal": all(int(got[k].argmax()) == int(want[k].argmax()) for k in got),
                "tolerance": bound,
            }
            if max(errors.values()) > bound:
                raise BuildError(f"engine verification failed ({kind} backend), logits differ from HF eager: "
                                 f"{json.dumps(result)}")  # fmt: skip
    return result


def _plain(config: EngineConfig) -> bool:
    """float32 weights and KV pool: quantized ones keep the backend their gate ran on."""
    return config.dtype == "float32" and config.quantization is None and not config.kv_quantized


def _runs_bf16(config: EngineConfig) -> bool:
    """A float32 engine is also verified on cpu-bf16 (dense layers in bfloat16, at bfloat16's bound) where
    this CPU is one it is the default on."""
    return _plain(config) and config.has_cpu_segments and amx_bf16()


def runs_int8(config: EngineConfig) -> bool:
    """A float32 engine is also verified on cpu-int8 (then gated) where this CPU multiplies int8 in vector loops
    (AVX512-VNNI or AVX2) and has no AMX (where cpu-bf16 is the default): elsewhere its portable loops would make
    the build slow."""
    return _plain(config) and int8_simd() and not amx_bf16()


def _backends(config: EngineConfig, blocks: int, scratch: Path):
    """(kind, backend) for each backend the engine is verified on, over 2 x `blocks` KV blocks."""
    num_blocks = 2 * blocks
    if config.dtype == "bfloat16":
        view = float32_view(config, scratch)
        yield "graph", create_backend(view, num_blocks=num_blocks, kind="graph")
        yield "plugin", create_backend(view, num_blocks=num_blocks, kind="plugin")
        yield "cpu-bf16", create_backend(config, num_blocks=num_blocks, kind="cpu-bf16")
    else:
        for kind in ("graph", "plugin", "cpu") if config.has_cpu_segments else ("graph", "plugin"):
            yield kind, create_backend(config, num_blocks=num_blocks, kind=kind)
        if _runs_bf16(config):
            yield "cpu-bf16", create_backend(config, num_blocks=num_blocks, kind="cpu-bf16")
        if runs_int8(config):
            yield "cpu-int8", create_backend(config, num_blocks=num_blocks, kind="cpu-int8")
    if config.target == "tensorrt":
        yield "tensorrt", create_backend(config, num_blocks=num_blocks, kind="tensorrt")


def _run(backend: EngineBackend, tokens: list[int], block_size: int) -> dict[str, np.ndarray]:
    """Logits of the prompt's last token (one-shot and in two chunks) and of a decode step after it."""
    prompt, next_token = tokens[:-1], tokens[-1]
    blocks = ceil_div(len(tokens), block_size)
    table_a, table_b = list(range(blocks)), list(range(blocks, 2 * blocks))
    split = len(prompt) // 2
    got = {
        "prefill": backend.step([SequenceChunk(prompt, 0, table_a)])[0],
        "decode": backend.step([SequenceChunk([next_token], len(prompt), table_a)])[0],
    }
    backend.step([SequenceChunk(prompt[:split], 0, table_b)])
    got["chunked_prefill"] = backend.step([SequenceChunk(prompt[split:], split, table_b)])[0]
    return got


def float32_view(config: EngineConfig, out_dir: Path) -> EngineConfig:
    """The engine's two graphs with every bfloat16 type and weight widened to float32 (exactly: a bf16
    value is a float32 with the low mantissa bits zero), written to `out_dir`: the same function over
    the same weights, in the arithmetic ONNX Runtime runs on CPUs."""
    for graph_file in (GRAPH_FILE, PLUGIN_GRAPH_FILE):
        model = onnx.load(str(config.engine_dir / graph_file))
        _widen_graph(model.graph)
        for function in model.functions:
            for node in function.node:
                _widen_node(node)
        onnx.save_model(model, str(out_dir / graph_file), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=graph_file + ".data", size_threshold=1024)  # fmt: skip
    return dataclasses.replace(config, engine_dir=out_dir, dtype="float32")


def _widen_graph(graph: onnx.GraphProto) -> None:
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == TensorProto.BFLOAT16:
            graph.initializer[index].CopyFrom(_widened(tensor))
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        _widen_node(node)


def _widen_node(node: onnx.NodeProto) -> None:
    for attribute in node.attribute:
        if attribute.type == AttributeProto.INT and attribute.i == TensorProto.BFLOAT16 and attribute.name == "to":
            attribute.i = TensorProto.FLOAT  # Cast
        elif attribute.type == AttributeProto.TENSOR and attribute.t.data_type == TensorProto.BFLOAT16:
            attribute.t.CopyFrom(_widened(attribute.t))  # Constant
        elif attribute.type == AttributeProto.GRAPH:
            _widen_graph(attribute.g)


def _widened(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)

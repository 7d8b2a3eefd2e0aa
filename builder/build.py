"""The build pipeline: model source -> ONNX with paged KV -> verified engine directory."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from builder.engine_dir import atomic_directory, write_manifest
from builder.errors import BuildError
from builder.export import DTYPES, WEIGHTS_FILE, ExportOptions, export_onnx
from builder.model_spec import ModelSpec
from builder.onnx_graph import IR_VERSION, OPSET
from builder.plugin_graph import PLUGIN_FILE, write_plugin_graph
from builder.sources import load_checkpoint, resolve_model

BACKENDS = ("onnxruntime-cpu",)
# Max |logit difference| between the engine and HF eager on the verification prompt, as a
# fraction of the largest |logit|. fp32 differs only in summation order (measured ~1e-6 on
# tiny models, ~1e-5 on SmolLM2); 1e-3 still catches any wrong op, weight or mask.
VERIFY_TOLERANCE = {"float32": 1e-3, "float16": 3e-2}

StepReporter = Callable[[str], AbstractContextManager]


@dataclass(frozen=True)
class BuildOptions:
    model: str
    output: Path
    max_batch_size: int = 16
    max_seq_len: int = 2048
    block_size: int = 64
    dtype: str = "float32"
    backend: str = "onnxruntime-cpu"

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise BuildError(f"--max-batch-size must be >= 1 (got {self.max_batch_size})")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise BuildError(f"--block-size must be a power of two (got {self.block_size})")
        if self.max_seq_len < self.block_size:
            raise BuildError(f"--max-seq-len ({self.max_seq_len}) must be >= --block-size ({self.block_size})")
        if self.dtype not in DTYPES:
            raise BuildError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.backend not in BACKENDS:
            raise BuildError(f"--backend must be one of {', '.join(BACKENDS)} (got {self.backend!r})")


def _no_report(title: str) -> AbstractContextManager:
    return contextlib.nullcontext()


def build_engine(options: BuildOptions, step: StepReporter = _no_report) -> dict:
    """Build the engine directory at options.output atomically; returns the manifest."""
    options.validate()
    with step("resolve model source (first use of a GGUF converts it, ~25 s)"):
        source = resolve_model(options.model)
    with step(f"load checkpoint {source.checkpoint_dir}"):
        model, tokenizer = load_checkpoint(source)
        spec = ModelSpec.from_hf_config(model.config)
    if options.max_seq_len > spec.max_position_embeddings:
        raise BuildError(
            f"--max-seq-len {options.max_seq_len} exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    export_options = ExportOptions(options.block_size, options.max_seq_len, options.dtype)
    with atomic_directory(options.output) as staging:
        with step("export ONNX graph with paged KV interface"):
            graph_files = export_onnx(model, spec, export_options, staging)
        with step("rewrite to the TensorRT plugin graph (fused prologue, paged attention)"):
            write_plugin_graph(staging)
            tokenizer.save_pretrained(staging)
            (staging / "source_config.json").write_text(model.config.to_json_string())
        with step("verify engine against HF eager (prefill, chunked prefill, decode)"):
            verification = verify_engine(staging, model, options, spec, len(graph_files) - 1)
        manifest = _manifest(options, source, spec, verification, graph_files[1:])
        write_manifest(staging, manifest)
    return manifest


def _manifest(options: BuildOptions, source, spec: ModelSpec, verification: dict, segments: list[str]) -> dict:
    from runtime.engine_config import FORMAT, FORMAT_VERSION

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "backend": options.backend,
        "dtype": options.dtype,
        "source": {"model": options.model, "name": source.name, **source.origin},
        "model": spec.to_dict(),
        "limits": {
            "max_batch_size": options.max_batch_size,
            "max_seq_len": options.max_seq_len,
            "block_size": options.block_size,
        },
        "kv_layout": {
            "pool_shape": ["num_layers", 2, "num_blocks", options.block_size, spec.kv_width],
            "pool_dtype": options.dtype,
            "per_layer_inputs": ["key_cache.{layer}", "value_cache.{layer}"],
            "row_layout": "[kv_heads, head_dim] flattened; RoPE applied to keys before caching",
            "bytes_per_token": 2 * spec.num_layers * spec.kv_width * np.dtype(DTYPES[options.dtype][0]).itemsize,
        },
        "graph": {
            "file": "model.onnx",
            "weights": WEIGHTS_FILE,
            "opset": OPSET,
            "ir_version": IR_VERSION,
            "interface": "builder/INTERFACE.md (paged-KV step interface v1)",
            "cpu_segments": segments,
            "plugin_graph": PLUGIN_FILE,
        },
        "verification": verification,
        "build_options": {k: str(v) for k, v in asdict(options).items()},
    }


def verify_engine(engine_dir: Path, model, options: BuildOptions, spec: ModelSpec, cpu_segments: int) -> dict:
    """Run the new engine on every CPU backend it supports and compare logits with the HF
    model (float32): one-shot prefill, the same prompt in two chunks over the paged pool,
    and a decode step. Fails the build when any differs by more than VERIFY_TOLERANCE."""
    import torch

    from runtime.backend import SequenceChunk
    from runtime.backends import create_backend
    from runtime.engine_config import EngineConfig

    # The manifest is written after verification: give the backends their config directly.
    config = EngineConfig(
        engine_dir=engine_dir, backend=options.backend, dtype=options.dtype,
        block_size=options.block_size, max_batch_size=options.max_batch_size,
        max_seq_len=options.max_seq_len, graph_file="model.onnx", model=spec, cpu_segments=cpu_segments,
    )  # fmt: skip
    prompt_len = min(options.max_seq_len - 1, options.block_size + 7)
    tokens = np.random.default_rng(0).integers(3, spec.vocab_size, prompt_len + 1).tolist()
    prompt, next_token = tokens[:-1], tokens[-1]
    with torch.no_grad():
        ref_logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    want = {"prefill": ref_logits[-2], "chunked_prefill": ref_logits[-2], "decode": ref_logits[-1]}
    scale = float(np.abs(ref_logits).max())
    tolerance = VERIFY_TOLERANCE[options.dtype] * scale
    blocks = -(-(prompt_len + 1) // options.block_size)
    table_a, table_b = list(range(blocks)), list(range(blocks, 2 * blocks))
    split = prompt_len // 2
    result = {"prompt_tokens": prompt_len, "max_abs_logit": scale, "tolerance": tolerance, "backends": {}}
    for kind in ("graph", "plugin", "cpu") if cpu_segments else ("graph", "plugin"):
        backend = create_backend(config, num_blocks=2 * blocks, kind=kind)
        got = {
            "prefill": backend.step([SequenceChunk(prompt, 0, table_a)])[0],
            "decode": backend.step([SequenceChunk([next_token], prompt_len, table_a)])[0],
        }
        backend.step([SequenceChunk(prompt[:split], 0, table_b)])
        got["chunked_prefill"] = backend.step([SequenceChunk(prompt[split:], split, table_b)])[0]
        errors = {k: float(np.abs(got[k] - want[k]).max()) for k in got}
        result["backends"][kind] = {
            "max_abs_error": errors,
            "argmax_equal": all(int(got[k].argmax()) == int(want[k].argmax()) for k in got),
        }
        if max(errors.values()) > tolerance:
            raise BuildError(f"engine verification failed ({kind} backend), logits differ from HF eager: "
                             f"{json.dumps(result)}")  # fmt: skip
    return result

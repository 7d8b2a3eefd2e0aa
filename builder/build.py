"""The build pipeline: model source -> ONNX with paged KV -> verified engine directory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from builder.engine_dir import atomic_directory, write_manifest
from builder.errors import BuildError
from builder.export import DTYPES, ExportOptions, export_onnx
from builder.hf_config import model_spec_from_hf_config
from builder.onnx_graph import IR_VERSION, OPSET
from builder.plugin_graph import write_plugin_graph
from builder.sources import load_checkpoint, resolve_model
from builder.verify import runs_int8, verify_engine
from calibration.activations import activation_ranges
from calibration.data import DataConfig, TextSets, load_text_sets
from calibration.gate import run_backend_gate, run_gate
from calibration.job import write_gate_report
from calibration.kv_scales import measure_kv_scales
from calibration.quantize import QuantConfig, quantize_model
from engine_format import TARGETS, EngineConfig, ModelSpec, TensorRTLimits
from engine_format.files import ACTIVATION_RANGES_FILE, GATE_REPORT_JSON, SOURCE_CONFIG_FILE
from engine_format.kv_cache import KV_CACHE_DTYPES, QUANTIZED_KV_DTYPES, SCALES_SHAPE, bytes_per_token, pool_dtype

StepReporter = Callable[[str], AbstractContextManager]
INT8_RANGE_SEQUENCES = 16  # calibration sequences whose activation ranges smooth cpu-int8 (SmoothQuant)


@dataclass(frozen=True)
class BuildOptions:
    model: str
    output: Path
    max_batch_size: int = 16
    max_seq_len: int = 2048
    block_size: int = 64
    dtype: str = "float32"
    target: str = "onnxruntime-cpu"  # engine_format.TARGETS
    quantize: str | None = None  # calibration.quantize.QUANT_METHODS
    int4_block_size: int = 32
    calibration: DataConfig = field(default_factory=DataConfig)
    gate_config: Path | None = None  # default: calibration/gate_v1.json
    accept_gate_failure: bool = False  # promote even if the gate fails (recorded in the manifest)
    kv_cache_dtype: str = "auto"  # engine_format.kv_cache.KV_CACHE_DTYPES
    quantize_lm_head: bool = False  # INT4 only (calibration.quantize.QuantConfig.lm_head)

    @property
    def gated(self) -> bool:
        """Quantized weights or KV cache: the quality gate decides whether the engine is promoted."""
        return bool(self.quantize) or self.kv_cache_dtype in QUANTIZED_KV_DTYPES

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise BuildError(f"--max-batch-size must be >= 1 (got {self.max_batch_size})")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise BuildError(f"--block-size must be a power of two (got {self.block_size})")
        if self.max_seq_len < self.block_size:
            raise BuildError(f"--max-seq-len ({self.max_seq_len}) must be >= --block-size ({self.block_size})")
        if self.dtype not in DTYPES:
            raise BuildError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.target not in TARGETS:
            raise BuildError(f"--target must be one of {', '.join(TARGETS)} (got {self.target!r})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BuildError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {self.kv_cache_dtype})"
            )
        if self.dtype == "bfloat16" and self.gated:
            raise BuildError(
                "--dtype bfloat16 builds unquantized engines (the quality gate runs on the float32 CPU backend): "
                "drop --quantize/--kv-cache-dtype, or build --dtype float32"
            )
        if self.quantize_lm_head and not (self.quantize or "").startswith("int4"):
            raise BuildError(f"--quantize-lm-head needs --quantize int4-awq or int4-rtn (got {self.quantize})")
        if self.kv_cache_dtype in QUANTIZED_KV_DTYPES and (self.target != "onnxruntime-cpu" or self.dtype != "float32"):
            # Both graph forms read and write a quantized pool for any dtype, but the quality gate and the
            # fp8 scale calibration run on the CPU backend (float32 segments), and the TensorRT plugins
            # (plugins_cuda/trt_plugins.py) register the float-pool ops only.
            raise BuildError(
                f"--kv-cache-dtype {self.kv_cache_dtype} is supported for --target onnxruntime-cpu --dtype float32 "
                f"only (the quality gate runs on the float32 CPU backend; no TensorRT plugin takes a quantized "
                f"pool yet); got --target {self.target} --dtype {self.dtype}"
            )


def _no_report(title: str) -> AbstractContextManager:
    return contextlib.nullcontext()


def build_engine(options: BuildOptions, step: StepReporter = _no_report) -> dict:
    """Build the engine directory at options.output atomically; returns the manifest."""
    options.validate()
    if options.target == "tensorrt":
        from builder.tensorrt_build import require_tensorrt  # TensorRT imports only when targeted

        require_tensorrt()  # first: without TensorRT or a GPU, fail at once and leave --output untouched
    with step("resolve model source (first use of a GGUF converts it, ~25 s)"):
        source = resolve_model(options.model)
    with step(f"load checkpoint {source.checkpoint_dir}"):
        model, tokenizer = load_checkpoint(source)
        spec = model_spec_from_hf_config(model.config)
    if options.max_seq_len > spec.max_position_embeddings:
        raise BuildError(
            f"--max-seq-len {options.max_seq_len} exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    export_options = ExportOptions(options.block_size, options.max_seq_len, options.dtype, options.kv_cache_dtype)
    with atomic_directory(options.output) as staging, tempfile.TemporaryDirectory() as scratch:
        quantization = None
        if options.gated:
            quantization = _calibrate(model, tokenizer, spec, options, Path(scratch), step)
        with step("export ONNX graph with paged KV interface"):
            weights = quantization.weights if quantization and quantization.weights else None
            graph_files = export_onnx(model, spec, export_options, staging, weights)
        with step("rewrite to the TensorRT plugin graph (fused prologue, paged attention)"):
            write_plugin_graph(staging)
            tokenizer.save_pretrained(staging)
            (staging / SOURCE_CONFIG_FILE).write_text(model.config.to_json_string())
        config = engine_config(staging, options, spec, len(graph_files) - 1, options.quantize)
        if options.kv_cache_dtype != "auto":
            config = _with_kv_cache(config, options, quantization, step)
        trt_section = {}
        if options.target == "tensorrt":
            from builder.tensorrt_build import build_plan

            with step("compile the TensorRT engine (plugin graph, AOT kernels)"):
                trt_section = build_plan(staging, config)
        texts = quantization.texts if quantization else None
        if runs_int8(config):  # before verification: the cpu-int8 backend it checks reads them
            with step("load calibration and held-out text for the cpu-int8 backend"):
                texts = texts or load_text_sets(tokenizer, options.calibration)
            with step(f"measure activation ranges for cpu-int8 ({INT8_RANGE_SEQUENCES} calibration sequences)"):
                ranges = activation_ranges(model, spec, texts.calibration[:INT8_RANGE_SEQUENCES])
                np.savez(staging / ACTIVATION_RANGES_FILE, **ranges)
        with step("verify engine against HF eager (prefill, chunked prefill, decode)"):
            verification = verify_engine(config, model)
        if "cpu-int8" in verification["backends"]:
            assert texts is not None
            with step("quality gate: cpu-int8 (int8 dense layers) vs the float32 CPU backend on held-out text"):
                verification["backends"]["cpu-int8"]["gate"] = _gate_backend(
                    "cpu-int8", config, tokenizer, texts, options.gate_config
                )
        manifest = config.manifest_fields()
        manifest["graph"].update(opset=OPSET, ir_version=IR_VERSION)
        manifest.update(_provenance(options, source, spec, verification))
        if trt_section:
            manifest["tensorrt"].update(trt_section)
        if quantization:
            gate = _gate(quantization, tokenizer, options, config, step)
            if options.quantize:
                manifest["quantization"].update({**quantization.record, "gate": gate})
            if config.kv_quantized:
                manifest["kv_cache"].update(gate=gate, calibration_data=quantization.record["calibration_data"])
        write_manifest(staging, manifest)
    return manifest


def engine_config(engine_dir: Path, options: BuildOptions, spec: ModelSpec, cpu_segments: int,
                  quantization: str | None = None) -> EngineConfig:  # fmt: skip
    """The format's view of an engine being built (its manifest is written last)."""
    trt = None
    if options.target == "tensorrt":
        trt = TensorRTLimits.from_build(options.max_batch_size, options.max_seq_len, options.block_size)
    return EngineConfig(
        engine_dir=engine_dir, target=options.target, dtype=options.dtype,
        block_size=options.block_size, max_batch_size=options.max_batch_size,
        max_seq_len=options.max_seq_len, model=spec, cpu_segments=cpu_segments,
        quantization=quantization, tensorrt=trt,
    )  # fmt: skip


def export_reference(model, spec: ModelSpec, block_size: int, max_seq_len: int, out_dir: Path) -> EngineConfig:
    """Export the unquantized float32 engine graphs the quality gate compares against."""
    files = export_onnx(model, spec, ExportOptions(block_size, max_seq_len), out_dir)
    options = BuildOptions(model="reference", output=out_dir, block_size=block_size, max_seq_len=max_seq_len)
    return engine_config(out_dir, options, spec, len(files) - 1)


def _calibrate(model, tokenizer, spec: ModelSpec, options: BuildOptions, scratch: Path, step: StepReporter):
    """Load the calibration and held-out text. Quantized weights: export the unquantized reference
    engine (for the gate) into `scratch`, then calibrate and quantize the model in place. A quantized
    KV cache alone is gated against the same engine with a model-dtype cache (reference None)."""
    config = None
    if options.quantize:
        config = QuantConfig(options.quantize, options.int4_block_size, lm_head=options.quantize_lm_head)
    if config and (problems := config.problems(spec)):
        raise BuildError("; ".join(problems))
    with step("load calibration and held-out text"):
        texts = load_text_sets(tokenizer, options.calibration)
    if config is None:
        return _Quantization({}, {"calibration_data": texts.record}, texts, None)
    with step("export the unquantized reference engine for the quality gate"):
        reference = export_reference(model, spec, options.block_size, options.max_seq_len, scratch)
    with step(f"calibrate and quantize ({options.quantize}, {len(texts.calibration)} sequences)"):
        weights, record = quantize_model(model, spec, config, texts.calibration)
    return _Quantization(weights, {**record, "calibration_data": texts.record}, texts, reference)


@dataclass
class _Quantization:
    weights: dict
    record: dict
    texts: TextSets
    reference: EngineConfig | None  # None: the candidate itself with a model-dtype KV cache


def _with_kv_cache(config: EngineConfig, options: BuildOptions, quantization: _Quantization | None,
                   step: StepReporter) -> EngineConfig:  # fmt: skip
    """The engine with its quantized KV cache; fp8 scales are measured on the calibration text."""
    scales = None
    if options.kv_cache_dtype == "fp8":
        assert quantization is not None
        sequences = quantization.texts.calibration
        with step(f"calibrate fp8 KV-cache scales per layer ({len(sequences)} sequences)"):
            scales = measure_kv_scales(config, sequences)
    return dataclasses.replace(config, kv_cache_dtype=options.kv_cache_dtype, kv_scales=scales)


def _gate(quantization: _Quantization, tokenizer, options: BuildOptions, candidate: EngineConfig,
          step: StepReporter) -> dict:  # fmt: skip
    """Run the quality gate; write its report into the engine; fail the build unless it passes
    or the override flag is given. Returns the manifest's gate record."""
    reference = quantization.reference or dataclasses.replace(candidate, kv_cache_dtype="auto", kv_scales=None)
    with step(f"quality gate: quantized (KV cache {candidate.kv_cache_dtype}) vs unquantized engine on held-out text"):
        report = run_gate(reference, candidate, quantization.texts, tokenizer, options.gate_config)
    write_gate_report(candidate.engine_dir, report)
    if not report.passed and not options.accept_gate_failure:
        # The engine is not promoted, but the evidence is kept beside where it would have gone.
        evidence = options.output.with_name(options.output.name + ".gate-failed.json")
        evidence.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        raise BuildError(
            f"quality gate failed; the engine was not written to {options.output} (full report: {evidence})\n"
            f"{report.table()}"
        )
    return {"passed": report.passed, "overridden": not report.passed, "report": GATE_REPORT_JSON,
            "gate_config_version": report.config_version}  # fmt: skip


def _gate_backend(kind: str, config: EngineConfig, tokenizer, texts: TextSets, gate_config: Path | None) -> dict:
    """The quality gate of a backend that quantizes the engine as it loads (cpu-int8) against the float32 CPU
    backend: it becomes a default backend (executors/factory.py) only if this passes. A failure does not fail
    the build (the engine itself is verified); the backend then serves only when asked for by name."""
    report = run_backend_gate(config, kind, texts, tokenizer, gate_config)
    record = report.to_dict()
    record["metrics"] = {k: v for k, v in record["metrics"].items() if k != "answers"}
    return record


def _provenance(options: BuildOptions, source, spec: ModelSpec, verification: dict) -> dict:
    """Manifest fields beyond the format's: where the engine came from and how it was checked."""
    kv = options.kv_cache_dtype
    layout = {
        "pool_shape": ["num_layers", 2, "num_blocks", options.block_size, spec.kv_width],
        "pool_dtype": pool_dtype(options.dtype, kv),
        "per_layer_inputs": ["key_cache.{layer}", "value_cache.{layer}"],
        "row_layout": "[kv_heads, head_dim] flattened; RoPE applied to keys before caching",
        "bytes_per_token": bytes_per_token(spec, options.dtype, kv),
    }
    if kv == "int8":
        layout["scales"] = {"shape": list(SCALES_SHAPE), "dtype": "float32", "per": "token x kv head, absmax/127"}
    elif kv == "fp8":
        layout["scales"] = {"per": "layer, K and V (manifest kv_cache.scales)", "encoding": "float8_e4m3fn bits"}
    return {
        "source": {"model": options.model, "name": source.name, **source.origin},
        "kv_layout": layout,
        "verification": verification,
        "build_options": {k: str(v) for k, v in asdict(options).items()},
    }

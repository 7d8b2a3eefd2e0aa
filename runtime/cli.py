"""`trtserve`: run engines built by `build-engine`."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import click

from runtime.engine_config import EngineConfig, EngineLoadError
from runtime.errors import InvalidRequest


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """trtserve: compiled-engine LLM runtime (ONNX Runtime CPU today, TensorRT on GPU)."""


@main.command()
@click.option(
    "--engine",
    "engine_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Engine directory written by build-engine.",
)
@click.option("--prompt", required=True, help="The prompt text.")
@click.option(
    "--max-tokens",
    default=128,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most tokens to generate.",
)
@click.option(
    "--chat/--no-chat",
    default=True,
    show_default=True,
    help="Send the prompt as a user message through the model's chat template.",
)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = off.")
@click.option("--seed", default=None, type=int, help="Makes sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--stats", is_flag=True, help="Print token counts and timing to stderr.")
def generate(engine_dir: Path, prompt: str, max_tokens: int, chat: bool, temperature: float, top_p: float,
             top_k: int, seed: int | None, stop: tuple[str, ...], stats: bool) -> None:  # fmt: skip
    """Generate an answer to --prompt and stream it to stdout."""
    from transformers.utils import logging as transformers_logging

    from runtime.llm_engine import LLMEngine
    from runtime.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING)
    transformers_logging.set_verbosity_error()
    try:
        if not prompt.strip():
            raise InvalidRequest("--prompt", "must not be empty")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=stop)  # fmt: skip
        engine = LLMEngine(engine_dir)
        engine.add_request([{"role": "user", "content": prompt}] if chat else prompt, params)
    except (EngineLoadError, InvalidRequest) as exc:
        raise click.ClickException(str(exc)) from None
    start, final = time.perf_counter(), None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            click.echo(delta.text, nl=False)
            final = delta if delta.finished else final
    click.echo()
    if stats and final is not None:
        elapsed = time.perf_counter() - start
        s = final.stats
        print(
            f"prompt {final.num_prompt_tokens} tokens, generated {final.num_output_tokens} "
            f"({final.finish_reason}) in {elapsed:.2f} s; TTFT {1000 * s['ttft_s']:.0f} ms, "
            f"{(final.num_output_tokens - 1) / max(s['e2e_s'] - s['ttft_s'], 1e-9):.1f} tok/s decode",
            file=sys.stderr,
        )


@main.command()
@click.option(
    "--engine",
    "engine_dir",
    required=True,
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="Engine directory written by build-engine.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (all three endpoints).")
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(1, 65535))
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(1, 65535))
@click.option("--max-num-seqs", type=click.IntRange(min=1), help="Most requests batched at once (default: engine's).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), help="Per-step token budget (default 512).")
@click.option("--num-kv-blocks", type=click.IntRange(min=1), help="KV cache size in blocks (default: engine's).")
@click.option("--max-waiting", type=click.IntRange(min=1), help="Waiting-queue bound before 'overloaded' errors.")
@click.option("--no-prefix-caching", is_flag=True, help="Disable prefix caching.")
def serve(engine_dir: Path, host: str, http_port: int, grpc_port: int, metrics_port: int, max_num_seqs,
          max_num_batched_tokens, num_kv_blocks, max_waiting, no_prefix_caching: bool) -> None:  # fmt: skip
    """Serve an engine with NVIDIA Triton Inference Server (HTTP, gRPC, Prometheus metrics).

    Starts the real tritonserver with the trtserve `llm` model, waits until it is ready,
    prints the endpoints, and shuts down cleanly on Ctrl-C or SIGTERM.
    """
    import signal

    from runtime.serve.launcher import MODEL_NAME, ServerConfig, ServerError, TritonServer

    try:
        EngineConfig.load(engine_dir)
    except EngineLoadError as exc:
        raise click.ClickException(str(exc)) from None
    params = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
              "num_kv_blocks": num_kv_blocks, "max_waiting": max_waiting}  # fmt: skip
    engine_params = {k: str(v) for k, v in params.items() if v is not None}
    engine_params["enable_prefix_caching"] = "false" if no_prefix_caching else "true"
    config = ServerConfig(engine_dir, host, http_port, grpc_port, metrics_port, engine_params)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        server = TritonServer(config)
    except ServerError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        click.echo(f"starting tritonserver (log: {server.log_path}) ...", err=True)
        server.wait_ready()
        click.echo(f"ready: model '{MODEL_NAME}'\n"
                   f"  HTTP     http://{host}:{http_port}/v2/models/{MODEL_NAME}/generate (and generate_stream)\n"
                   f"  gRPC     {host}:{grpc_port}\n"
                   f"  metrics  http://{host}:{metrics_port}/metrics")  # fmt: skip
        while not stop and server.process.poll() is None:
            time.sleep(0.2)
        if server.process.poll() is not None and not stop:
            raise ServerError(f"tritonserver exited unexpectedly:\n{server.log_tail()}")
    except ServerError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        click.echo("stopping tritonserver ...", err=True)
        server.stop()


@main.command()
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
    .md in the engine directory, and exits 1 when the gate fails.
    """
    from calibration.job import CalibrationJobError, regate_engine

    try:
        report = regate_engine(engine_dir, gate_config)
    except (CalibrationJobError, EngineLoadError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(report.table())
    if not report.passed:
        sys.exit(1)


@main.command()
@click.option(
    "--arch",
    "archs",
    multiple=True,
    required=True,
    type=click.Choice(["sm_80", "sm_89", "sm_90"]),
    help="GPU architecture (repeatable).",
)
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@click.option("--dtype", default="float16", show_default=True, type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option("--hidden", default=576, show_default=True, type=click.IntRange(min=16))
@click.option("--num-heads", default=9, show_default=True, type=click.IntRange(min=1))
@click.option("--num-kv-heads", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--head-dim", default=64, show_default=True, type=click.IntRange(min=32))
@click.option("--block-size", default=64, show_default=True, type=click.IntRange(min=16))
@click.option("--qkv-bias", is_flag=True, help="Compile the prologue with a QKV bias (Qwen2).")
def kernels(archs, out_dir: Path, dtype: str, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
            block_size: int, qkv_bias: bool) -> None:  # fmt: skip
    """AOT-compile the GPU kernels (Triton language) to PTX and cubin, with launch metadata.

    Kernels: paged attention, and fused RMSNorm -> QKV -> RoPE. Needs no GPU: proves they
    compile for each architecture and lets a GPU user inspect them. Defaults are
    SmolLM2-135M's shapes.
    """
    import json

    try:
        from plugins_cuda import fused_qkv, paged_attention
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the kernels extra (pip install 'trtserve[kernels]')") from None
    if num_heads % num_kv_heads:
        raise click.ClickException(f"--num-heads ({num_heads}) must be a multiple of --num-kv-heads ({num_kv_heads})")
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = {"hidden": hidden, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
              "block_size": block_size, "qkv_bias": qkv_bias}  # fmt: skip
    for arch in archs:
        sm = int(arch[3:])
        builds = {
            "paged_attention": paged_attention.compile_for_arch(
                sm, dtype, num_kv_heads, num_heads // num_kv_heads, head_dim, block_size
            ),
            "fused_rmsnorm_qkv_rope": fused_qkv.compile_for_arch(
                sm, dtype, hidden, num_heads, num_kv_heads, head_dim, qkv_bias
            ),
        }
        for name, compiled in builds.items():
            stem, meta = f"{name}.{arch}", compiled.metadata
            (out_dir / f"{stem}.ptx").write_text(compiled.asm["ptx"])
            (out_dir / f"{stem}.cubin").write_bytes(compiled.asm["cubin"])
            info = {"kernel": meta.name, "arch": arch, "dtype": dtype, "num_warps": meta.num_warps,
                    "shared_memory_bytes": meta.shared, "global_scratch_bytes": meta.global_scratch_size,
                    "shapes": shapes}  # fmt: skip
            (out_dir / f"{stem}.json").write_text(json.dumps(info, indent=2) + "\n")
            click.echo(f"{arch}: {out_dir / stem}.{{ptx,cubin,json}} ({meta.shared} B shared, {meta.num_warps} warps)")

"""`trtserve`: run engines built by `build-engine`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, TypedDict, cast

import click

from engine_format import EngineConfig, EngineLoadError
from runtime.backends import BACKENDS
from runtime.engine.engine_args import DISABLE_BATCH_SIZE_DEFAULTS, MAX_SPECULATIVE_TOKENS, EngineArgs
from runtime.engine.errors import InvalidRequest
from runtime.engine.spec.proposer import SPECULATIVE_METHODS
from runtime.gateway.cli import API_KEY_ENV, DEFAULT_PORT
from runtime.gateway.cli import gateway as gateway_command
from runtime.serve.serve_loop import ADMIN_KEY_ENV

COMMAND_ENTRY_POINTS = "trtserve.commands"
BACKEND_HELP = (
    "Executor (default: TensorRT for TensorRT engines where installed, else torch on a GPU, else ORT). "
    "cpu-bf16: the CPU kernel backend with bfloat16 dense layers (oneDNN, AMX): faster, HF-bf16 numerics."
)


class _Commands(click.Group):
    """trtserve's own commands plus those other packages register under the `trtserve.commands`
    entry-point group (pyproject.toml): `calibrate` (builder + calibration) and `kernels`
    (plugins_cuda). They load when used, so the runtime imports neither package."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_registered_commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and (entry := _registered_commands().get(name)):
            command = entry.load()
        return command


def _registered_commands() -> dict[str, EntryPoint]:
    return {e.name: e for e in entry_points(group=COMMAND_ENTRY_POINTS)}


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """trtserve: compiled-engine LLM runtime (ONNX Runtime CPU today, TensorRT on GPU)."""


main.add_command(gateway_command)


class SpeculativeFields(TypedDict, total=False):
    """The EngineArgs fields the speculative-decoding options set (absent: the engine's default)."""

    speculative: str
    draft_engine: str
    num_speculative_tokens: int
    speculative_disable_batch_size: int
    draft_prompt_lookup_min: int


SPECULATIVE_OPTIONS = (
    click.option("--speculative", type=click.Choice(SPECULATIVE_METHODS), default=None,
                 help="Speculative decoding: 'ngram' proposes the tokens that followed the latest earlier occurrence "
                      "of the text's last words (prompt lookup); 'draft' lets --draft-engine (same tokenizer) "
                      "propose. Greedy output is unchanged; sampled output keeps the model's distribution."),
    click.option("--draft-engine", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
                 help="Engine directory of the draft model (with --speculative draft), e.g. an INT4 build of the "
                      "same model."),
    click.option("--num-speculative-tokens", type=click.IntRange(1, MAX_SPECULATIVE_TOKENS), default=None,
                 help=f"Draft tokens verified per step (default {EngineArgs.num_speculative_tokens})."),
    click.option("--speculative-disable-batch-size", type=click.IntRange(min=1), default=None,
                 help="Speculation pauses while more requests than this run or wait: a large batch pays for "
                      f"drafts in compute (default: {DISABLE_BATCH_SIZE_DEFAULTS}, as measured)."),
    click.option("--draft-prompt-lookup-min", type=click.IntRange(min=0), default=None,
                 help="With --speculative draft: a request whose text ends in this many or more tokens seen earlier "
                      "in it takes the prompt-lookup guess, free, instead of the draft model's; 0: the draft model "
                      f"always (default {EngineArgs.draft_prompt_lookup_min})."),
)  # fmt: skip


def speculative_options(command: Callable[..., None]) -> Callable[..., None]:
    """The speculative-decoding options of `generate` and `serve`, defined once: checked together and
    handed to `command` as one `speculative` argument, the EngineArgs fields they set."""

    @functools.wraps(command)
    def run(*args: Any, speculative: str | None, draft_engine: Path | None, num_speculative_tokens: int | None,
            speculative_disable_batch_size: int | None, draft_prompt_lookup_min: int | None,
            **kwargs: Any) -> None:  # fmt: skip
        fields = speculative_args(speculative, draft_engine, num_speculative_tokens, speculative_disable_batch_size,
                                  draft_prompt_lookup_min)  # fmt: skip
        command(*args, speculative=fields, **kwargs)

    for option in reversed(SPECULATIVE_OPTIONS):
        run = option(run)
    return run


def speculative_args(method: str | None, draft_engine: Path | None, num_tokens: int | None,
                     disable_batch_size: int | None, lookup_min: int | None) -> SpeculativeFields:  # fmt: skip
    """EngineArgs fields of the options (none: speculation off); a missing or stray one is a usage error
    naming it (raised before any engine loads or server starts)."""
    if method == "draft" and draft_engine is None:
        raise click.UsageError("--speculative draft needs --draft-engine DIR (the draft model's engine directory)")
    for name, value in (("--draft-engine", draft_engine), ("--draft-prompt-lookup-min", lookup_min)):
        if value is not None and method != "draft":
            raise click.UsageError(f"{name} is only used with --speculative draft")
    if method is None and (num_tokens is not None or disable_batch_size is not None):
        raise click.UsageError("--num-speculative-tokens and --speculative-disable-batch-size need --speculative")
    fields = {"speculative": method, "draft_engine": None if draft_engine is None else str(draft_engine),
              "num_speculative_tokens": num_tokens, "speculative_disable_batch_size": disable_batch_size,
              "draft_prompt_lookup_min": lookup_min}  # fmt: skip
    return cast(SpeculativeFields, {k: v for k, v in fields.items() if v is not None})


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
@click.option("--backend", type=click.Choice(BACKENDS), default=None, help=BACKEND_HELP)
@speculative_options
def generate(engine_dir: Path, prompt: str, max_tokens: int, chat: bool, temperature: float, top_p: float,
             top_k: int, seed: int | None, stop: tuple[str, ...], stats: bool,
             backend: str | None, speculative: SpeculativeFields) -> None:  # fmt: skip
    """Generate an answer to --prompt and stream it to stdout."""
    from transformers.utils import logging as transformers_logging

    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING)
    transformers_logging.set_verbosity_error()
    try:
        if not prompt.strip():
            raise InvalidRequest("--prompt", "must not be empty")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=stop)  # fmt: skip
        args = EngineArgs(backend=backend, **speculative)
        engine = LLMEngine(engine_dir, args)
        engine.add_request([{"role": "user", "content": prompt}] if chat else prompt, params)
    except (EngineLoadError, InvalidRequest, ValueError) as exc:
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
        ttft, e2e = (s["ttft_s"], s["e2e_s"]) if s is not None else (None, None)
        timing = (
            f"; TTFT {1000 * ttft:.0f} ms, {(final.num_output_tokens - 1) / max(e2e - ttft, 1e-9):.1f} tok/s decode"
            if ttft is not None and e2e is not None
            else ""  # no token came (the request failed first)
        )
        print(
            f"prompt {final.num_prompt_tokens} tokens, generated {final.num_output_tokens} "
            f"({final.finish_reason}) in {elapsed:.2f} s{timing}",
            file=sys.stderr,
        )
        spec = engine.stats().spec_decode
        if spec is not None:
            print(
                f"speculative: {spec.drafts} verify passes, {spec.draft_tokens} drafts, {spec.accepted_tokens} "
                f"accepted ({100 * spec.acceptance_rate:.0f}%), {spec.mean_acceptance_length:.2f} tokens per pass; "
                f"accepted per position {list(spec.accepted_per_position)}",
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
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of the OpenAI endpoint (public).")
@click.option(
    "--triton-host",
    default="127.0.0.1",
    show_default=True,
    help="Address of tritonserver's HTTP, gRPC and metrics endpoints (loopback: only the gateway reaches them).",
)
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(1, 65535))
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(1, 65535))
@click.option("--max-num-seqs", type=click.IntRange(min=1), help="Most requests batched at once (default: engine's).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), help="Per-step token budget (default 512).")
@click.option("--num-kv-blocks", type=click.IntRange(min=1), help="KV cache size in blocks (default: engine's).")
@click.option("--max-waiting", type=click.IntRange(min=1), help="Waiting-queue bound before 'overloaded' errors.")
@click.option("--itl-target-ms", type=click.FloatRange(min=0), help="ITL target; caps prefill (default 200, 0: off).")
@click.option("--no-prefix-caching", is_flag=True, help="Disable prefix caching.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None, help=BACKEND_HELP)
@click.option(
    "--stream-interval",
    type=click.IntRange(min=1),
    help="Tokens per streamed response, the first and last at once (default 1); fewer responses cost the server less.",
)
@click.option(
    "--openai-port",
    default=DEFAULT_PORT,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of the OpenAI-compatible endpoint (`trtserve gateway`, started alongside).",
)
@click.option("--no-openai", is_flag=True, help="Do not start the OpenAI-compatible endpoint.")
@click.option(
    "--api-key",
    envvar=API_KEY_ENV,
    show_envvar=True,
    default=None,
    help="Require 'Authorization: Bearer <key>' on the OpenAI endpoint.",
)
@click.option(
    "--tenants",
    "tenants_path",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="A .yaml/.toml file with a `tenants:` section: several API keys, each its own tenant with its own "
    "limits and prefix cache (runtime/gateway/tenants.py); instead of --api-key.",
)
@click.option(
    "--admin-key",
    envvar=ADMIN_KEY_ENV,
    show_envvar=True,
    default=None,
    help="Value of the 'admin-key' header Triton's shared-memory, model-repository, logging and trace APIs "
    "require (default: a random key, i.e. nobody).",
)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds running requests may go on after SIGTERM; the rest end with a 'server shutting down' error.",
)
@click.option(
    "--health-interval",
    "health_interval_s",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between health probes of the model.",
)
@click.option(
    "--max-restarts",
    default=5,
    show_default=True,
    type=click.IntRange(min=0),
    help="Restarts of a dead or stuck tritonserver or gateway allowed per minute; past them (or at the first "
    "failure with 0) the server stops with exit code 3.",
)
@click.option(
    "--stall-timeout",
    "stall_timeout_s",
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds the model may show no progress (no engine step with requests unfinished, no heartbeat) "
    "before tritonserver is restarted.",
)
@speculative_options
def serve(engine_dir: Path, host: str, triton_host: str, http_port: int, grpc_port: int, metrics_port: int,
          max_num_seqs: int | None, max_num_batched_tokens: int | None, num_kv_blocks: int | None,
          max_waiting: int | None, no_prefix_caching: bool, openai_port: int, no_openai: bool, api_key: str | None,
          tenants_path: Path | None, admin_key: str | None, drain_timeout_s: float, health_interval_s: float,
          stall_timeout_s: float, max_restarts: int, itl_target_ms: float | None, backend: str | None,
          stream_interval: int | None, speculative: SpeculativeFields) -> None:  # fmt: skip
    """Serve an engine with NVIDIA Triton Inference Server (HTTP, gRPC, Prometheus metrics).

    Starts the real tritonserver with the trtserve `llm` model, waits until it is ready,
    starts the OpenAI endpoint next to it (model name: the engine directory's; it also serves
    Triton's KServe HTTP routes with bounded bodies), prints the endpoints, and watches the
    model (health probes every --health-interval seconds, its heartbeat): a dead or stuck model,
    tritonserver or gateway is restarted, with backoff; past 5 restarts a minute the server
    stops with exit code 3 (for an orchestrator to decide). On Ctrl-C or SIGTERM it stops
    admitting requests, lets running ones finish within --drain-timeout, ends the rest with an
    error, and exits with code 4 if any had to be cut (5 if the model crashed while stopping).
    """
    from runtime.engine.spec.draft import check_draft_vocabulary
    from runtime.gateway.process import GatewayProcess, GatewayProcessError, start_beside_triton
    from runtime.serve.launcher import ServerConfig, ServerError, TritonServer
    from runtime.serve.restarts import RestartBudget
    from runtime.serve.serve_loop import run_serve

    if api_key and tenants_path is not None:
        raise click.UsageError("--api-key and --tenants exclude each other: put the key in the tenants file")
    try:
        target = EngineConfig.load(engine_dir, verify=True)
        if "draft_engine" in speculative:  # refused here, not in tritonserver's log
            check_draft_vocabulary(speculative["draft_engine"], target)
    except EngineLoadError as exc:
        raise click.ClickException(str(exc)) from None
    params = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
              "num_kv_blocks": num_kv_blocks, "max_waiting": max_waiting, "itl_target_ms": itl_target_ms,
              "backend": backend, "stream_interval": stream_interval}  # fmt: skip
    engine_params = {k: str(v) for k, v in {**params, **speculative}.items() if v is not None}
    engine_params["enable_prefix_caching"] = "false" if no_prefix_caching else "true"
    config = ServerConfig(engine_dir, triton_host, http_port, grpc_port, metrics_port, engine_params,
                          drain_timeout_s=drain_timeout_s)  # fmt: skip
    if admin_key:
        config = dataclasses.replace(config, admin_key=admin_key)
    try:
        server = TritonServer(config)
    except ServerError as exc:
        raise click.ClickException(str(exc)) from None
    served_name = engine_dir.resolve().name

    def start_gateway(grpc_address: str, http_address: str) -> GatewayProcess:
        return start_beside_triton(grpc_address, served_name, host, openai_port, api_key, http_address, tenants_path)

    starter = None if no_openai else start_gateway
    budget = RestartBudget(max_per_window=max_restarts)
    sys.exit(run_serve(server, starter, served_name, health_interval_s, (GatewayProcessError,), stall_timeout_s,
                       budget))  # fmt: skip

"""`trtserve serve`: an engine behind NVIDIA Triton Inference Server, with the OpenAI gateway beside it, supervised."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import click

from engine_format import EngineConfig, EngineLoadError
from runtime.cli_options import engine_options
from runtime.engine.engine_args import EngineArgs, served_settings, to_parameters
from runtime.gateway.cli import API_KEY_ENV, DEFAULT_PORT
from runtime.serve.serve_loop import ADMIN_KEY_ENV
from runtime.serve.standby import STANDBY_ENV


@click.command()
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
@click.option(
    "--standby/--no-standby",
    default=None,
    envvar=STANDBY_ENV,
    show_envvar=True,
    help="A warm spare: a second tritonserver with the engine loaded, on free loopback ports, which the OpenAI "
    "gateway uses while the first cannot serve; a dead model's requests and streams then go on there at once "
    "instead of after its restart, and it reads the KV the dead engine wrote (a KV disk tier the two share: "
    "--kv-disk-cache, else a temporary one). Default: on for CPU backends where the memory available holds the "
    "engine twice over (runtime/cli_standby.py); --standby starts one anyway, --no-standby never.",
)
@engine_options(served_settings())
def serve(
    engine_dir: Path,
    host: str,
    triton_host: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    openai_port: int,
    no_openai: bool,
    api_key: str | None,
    tenants_path: Path | None,
    admin_key: str | None,
    drain_timeout_s: float,
    health_interval_s: float,
    stall_timeout_s: float,
    max_restarts: int,
    standby: bool | None,
    engine_args: EngineArgs,
) -> None:
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
    from runtime.cli_standby import host_memory, plan_standby
    from runtime.engine.spec.draft import check_draft_vocabulary
    from runtime.gateway.process import GatewayProcess, GatewayProcessError, start_beside_triton
    from runtime.serve.launcher import ServerConfig, ServerError, TritonServer, free_port
    from runtime.serve.restarts import RestartBudget
    from runtime.serve.serve_loop import run_serve

    if api_key and tenants_path is not None:
        raise click.UsageError("--api-key and --tenants exclude each other: put the key in the tenants file")
    try:
        target = EngineConfig.load(engine_dir, verify=True)
        if engine_args.draft_engine is not None:  # refused here, not in tritonserver's log
            check_draft_vocabulary(engine_args.draft_engine, target)
    except EngineLoadError as exc:
        raise click.ClickException(str(exc)) from None
    plan = plan_standby(standby, target, engine_args, host_memory())
    if plan.message:
        click.echo(plan.message, err=True)
    config = ServerConfig(engine_dir, triton_host, http_port, grpc_port, metrics_port, to_parameters(plan.engine_args),
                          drain_timeout_s=drain_timeout_s)  # fmt: skip
    if admin_key:
        config = dataclasses.replace(config, admin_key=admin_key)
    served_name = engine_dir.resolve().name

    def start_gateway(
        grpc_address: str, http_address: str, standby_address: str | None, triton_alive: Callable[[], bool]
    ) -> GatewayProcess:
        return start_beside_triton(
            grpc_address,
            served_name,
            host,
            openai_port,
            api_key,
            http_address,
            tenants_path,
            triton_alive,
            standby_address,
        )

    starter = None if no_openai else start_gateway
    budget = RestartBudget(max_per_window=max_restarts)
    spare = None
    if plan.start:  # on loopback whatever --triton-host says: only the gateway reaches it
        spare = dataclasses.replace(
            config, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()
        )
    try:
        try:
            server = TritonServer(config)
        except ServerError as exc:
            raise click.ClickException(str(exc)) from None
        code = run_serve(
            server,
            starter,
            served_name,
            health_interval_s,
            (GatewayProcessError,),
            stall_timeout_s,
            budget,
            spare,
            None if plan.required else host_memory,
        )
    finally:
        plan.cleanup()
    sys.exit(code)

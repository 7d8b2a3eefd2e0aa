"""`trtserve gateway`: the OpenAI-compatible endpoint, in front of one or more tritonservers.

Imports only click (and the stdlib-only replica_config) at module level: `trtserve --help` must not load
FastAPI or gRPC.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import click

from runtime.gateway.replica_config import REPLICA_POLICIES, ReplicaPolicy

DEFAULT_PORT = 9000
API_KEY_ENV = "TRTSERVE_API_KEY"


@click.command()
@click.option(
    "--triton-url",
    "triton_urls",
    multiple=True,
    help="gRPC address of a tritonserver serving the trtserve `llm` model; repeat for replicas [default: "
    "127.0.0.1:8001, none with --prefill-url: then these are `both` workers, the fallback that recomputes].",
)
@click.option(
    "--standby-url",
    "standby_urls",
    multiple=True,
    help="gRPC address of a warm spare tritonserver (`trtserve serve` starts one where memory allows): a replica "
    "picked only while no --triton-url replica is healthy, and kept while it has requests open; repeat for more.",
)
@click.option(
    "--prefill-url",
    "prefill_urls",
    multiple=True,
    help="Disaggregation: gRPC address of a tritonserver started with `trtserve serve --role prefill`; repeat "
    "for replicas. Each request's prompt runs there (prefix-aware), then on a --decode-url worker.",
)
@click.option(
    "--decode-url",
    "decode_urls",
    multiple=True,
    help="Disaggregation: gRPC address of a tritonserver started with `--role decode`; repeat for replicas "
    "(the least loaded reads the prefill's KV and decodes).",
)
@click.option(
    "--prefill-metrics-url",
    "prefill_metrics_urls",
    multiple=True,
    help="Prometheus endpoint of each --prefill-url replica, in the same order.",
)
@click.option(
    "--decode-metrics-url",
    "decode_metrics_urls",
    multiple=True,
    help="Prometheus endpoint of each --decode-url replica, in the same order.",
)
@click.option(
    "--triton-http-url",
    default=None,
    help="tritonserver's HTTP endpoint (http://host:port): the gateway then serves Triton's KServe v2 routes "
    "(/v2/health, /v2/models/M[/config|/infer|/generate|/generate_stream]) with its own checks.",
)
@click.option(
    "--metrics-url",
    "metrics_urls",
    multiple=True,
    help="Prometheus endpoint of each --triton-url replica, in the same order (their load informs routing).",
)
@click.option(
    "--model",
    "model_name",
    default="llm",
    show_default=True,
    help="The model name clients ask for (listed by GET /v1/models).",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Gateway config file (several backends, virtual models, cascades); replaces --triton-url/--model.",
)
@click.option(
    "--tenants",
    "tenants_path",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="A .yaml/.toml file with only a `tenants:` section (API keys and their limits), beside --triton-url "
    "(or a --config without one).",
)
@click.option(
    "--routing",
    type=click.Choice(REPLICA_POLICIES),
    default=None,
    help="How a replica is chosen, for every backend (overrides the config; default: prefix).",
)
@click.option(
    "--ready-wait",
    "ready_wait_s",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds a request that has produced nothing waits for a replica to be ready again when none is "
    "(a restarting tritonserver); 0: 503 at once (overrides the config; default 30).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--api-key",
    envvar=API_KEY_ENV,
    show_envvar=True,
    default=None,
    help="Require 'Authorization: Bearer <key>' on /v1 endpoints; also enables the /admin endpoints. The "
    "one-tenant shorthand of the config's `tenants:` section (several keys, each with its limits).",
)
@click.option(
    "--max-queued",
    default=16384,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests waiting for an upstream slot before new ones get 429.",
)
@click.option(
    "--max-concurrent", default=256, show_default=True, type=click.IntRange(min=1), help="Requests upstream at once."
)
@click.option(
    "--per-key-concurrency",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests upstream at once for one tenant (user field, API key or client address).",
)
@click.option(
    "--header-timeout",
    "header_timeout_s",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a client has to send a request's head (from connecting, or from its first byte); then 408 "
    "and the connection closes (slow clients must not hold connections).",
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a client has to send a request's body once its head is complete; then 408 and close.",
)
@click.option(
    "--nice",
    default=0,
    show_default=True,
    type=click.IntRange(0, 19),
    help="Lower the gateway's CPU priority by this much: beside an engine on the same cores, so the engine's "
    "steps come first (`trtserve serve` uses 10).",
)
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
def gateway(triton_urls: tuple[str, ...], standby_urls: tuple[str, ...], prefill_urls: tuple[str, ...],
            decode_urls: tuple[str, ...], prefill_metrics_urls: tuple[str, ...], decode_metrics_urls: tuple[str, ...],
            triton_http_url: str | None, metrics_urls: tuple[str, ...], model_name: str,
            config_path: Path | None, tenants_path: Path | None, routing: ReplicaPolicy | None,
            ready_wait_s: float | None, host: str, port: int, api_key: str | None, max_queued: int,
            max_concurrent: int, per_key_concurrency: int, header_timeout_s: float, body_timeout_s: float, nice: int,
            log_level: str) -> None:  # fmt: skip
    """Serve OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models) over tritonserver's gRPC.

    Also GET /health (200 while a backend is ready), GET /metrics (Prometheus), with an admin key /admin
    (replicas at run time, per-tenant metrics), and with --triton-http-url Triton's KServe v2 HTTP routes.
    """
    import os

    os.nice(nice)  # before uvicorn and gRPC start their threads, which inherit it

    import uvicorn

    from runtime.gateway.app import create_app
    from runtime.gateway.replica_config import Replica, RoleSource, check_http_url
    from runtime.gateway.routing import Backend, GatewayConfig
    from runtime.gateway.service import Gateway, GatewaySettings
    from runtime.gateway.tenants import tenants_file
    from runtime.gateway.timeouts import ReadTimeouts, timed_protocol

    if bool(prefill_urls) != bool(decode_urls):
        raise click.UsageError("give --prefill-url and --decode-url together (a pool of each)")
    if (prefill_urls or triton_urls or standby_urls) and config_path:
        raise click.UsageError("--config lists the backends: give it alone, or --triton-url / --prefill-url")
    triton_urls = triton_urls or (() if prefill_urls or config_path else ("127.0.0.1:8001",))
    for urls, metric, flag in ((triton_urls, metrics_urls, "url"), (prefill_urls, prefill_metrics_urls, "prefill-url"),
                               (decode_urls, decode_metrics_urls, "decode-url")):  # fmt: skip
        if metric and len(metric) != len(urls):
            raise click.UsageError(f"{len(metric)} metrics URLs for {len(urls)} --{flag}")
    standbys = tuple(Replica(url, standby=True) for url in standby_urls)
    try:
        if config_path:
            config = GatewayConfig.load(config_path)
        elif prefill_urls:

            def source(urls: tuple[str, ...], metrics: tuple[str, ...]) -> RoleSource:
                return RoleSource(replicas=tuple(Replica(u, m) for u, m in zip(urls, metrics or [None] * len(urls),
                                                                                strict=True)))  # fmt: skip

            both = tuple(Replica(u, m) for u, m in zip(triton_urls, metrics_urls or [None] * len(triton_urls),
                                                       strict=True)) + standbys  # fmt: skip
            config = GatewayConfig({model_name: Backend(model_name, replicas=both, prefill=source(
                prefill_urls, prefill_metrics_urls), decode=source(decode_urls, decode_metrics_urls))})  # fmt: skip
        elif len(triton_urls) == 1 and not metrics_urls and not standbys:
            config = GatewayConfig.single(model_name, triton_urls[0])
        else:
            metrics: list[str | None] = list(metrics_urls) or [None] * len(triton_urls)
            replicas = tuple(Replica(url, m) for url, m in zip(triton_urls, metrics, strict=True)) + standbys
            config = GatewayConfig({model_name: Backend(model_name, replicas=replicas)})
        if ready_wait_s is not None:
            config = replace(config, routing=replace(config.routing, ready_wait_s=ready_wait_s))
        if tenants_path is not None:
            config = config.with_tenants(tenants_file(tenants_path))
        if triton_http_url is not None:
            check_http_url("--triton-http-url", triton_http_url)
        settings = GatewaySettings(api_key or None, max_queued, max_concurrent, per_key_concurrency, routing,
                                   triton_http_url)  # fmt: skip
        service = Gateway(config, settings)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"gateway config: {exc}") from None
    app = create_app(service)
    http = timed_protocol(ReadTimeouts(header_timeout_s, body_timeout_s))
    # What start-up made lives until exit: out of the collector's full passes, which would stall every stream
    # (as the Triton stub does, runtime/engine/heap.py).
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10, http=http)

"""`trtserve gateway`: the OpenAI-compatible endpoint, in front of one or more tritonservers.

Imports only click at module level: `trtserve --help` must not load FastAPI or gRPC.
"""

from __future__ import annotations

from pathlib import Path

import click

DEFAULT_PORT = 9000
API_KEY_ENV = "TRTSERVE_API_KEY"


@click.command()
@click.option(
    "--triton-url",
    default="127.0.0.1:8001",
    show_default=True,
    help="gRPC address of the tritonserver serving the trtserve `llm` model.",
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
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--api-key",
    envvar=API_KEY_ENV,
    show_envvar=True,
    default=None,
    help="Require 'Authorization: Bearer <key>' on /v1 endpoints.",
)
@click.option(
    "--max-queued",
    default=1024,
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
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
def gateway(triton_url: str, model_name: str, config_path: Path | None, host: str, port: int, api_key: str | None,
            max_queued: int, max_concurrent: int, per_key_concurrency: int, log_level: str) -> None:  # fmt: skip
    """Serve OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models) over tritonserver's gRPC.

    Also GET /health (200 while a backend is ready) and GET /metrics (Prometheus).
    """
    import uvicorn

    from runtime.gateway.app import create_app
    from runtime.gateway.routing import GatewayConfig
    from runtime.gateway.service import Gateway, GatewaySettings

    try:
        config = GatewayConfig.load(config_path) if config_path else GatewayConfig.single(model_name, triton_url)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"gateway config: {exc}") from None
    settings = GatewaySettings(api_key or None, max_queued, max_concurrent, per_key_concurrency)
    app = create_app(Gateway(config, settings))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)

"""Start tritonserver with an engine, stream one answer through it over gRPC, stop it.

python examples/serve_and_stream.py --engine engines/smollm2-135m --prompt "What is the capital of France?"
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).parent))
from grpc_stream_client import stream_answer

from runtime.serve.launcher import ServerConfig, ServerError, TritonServer


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path, exists=True))
@click.option("--prompt", required=True)
@click.option("--max-tokens", default=64, show_default=True)
def main(engine_dir: Path, prompt: str, max_tokens: int) -> None:
    config = ServerConfig.on_free_ports(engine_dir)
    click.echo(f"starting tritonserver on 127.0.0.1 (gRPC {config.grpc_port}) ...", err=True)
    with TritonServer(config) as server:
        try:
            server.wait_ready()
        except ServerError as exc:
            raise click.ClickException(str(exc)) from None
        stream_answer(f"127.0.0.1:{config.grpc_port}", prompt, max_tokens)
    click.echo("tritonserver stopped", err=True)


if __name__ == "__main__":
    main()

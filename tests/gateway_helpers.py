"""For gateway tests: a gateway process in front of tritonservers (one, or several replicas), OpenAI SDK
clients, the admin API, engine metrics by any name, and an engine slow enough that a request outlives a
cancel's trip (the tiny engines finish 240 tokens in ~70 ms)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from runtime.gateway.errors import GatewayError
from runtime.gateway.exchange import Exchange
from runtime.gateway.process import GatewayProcess
from runtime.serve.launcher import ServerConfig, TritonServer, free_port

SLOW_MAX_SEQ_LEN = 8192


@contextlib.contextmanager
def running_gateway(triton_grpc_port: int | None, model: str | None, *args: str, api_key: str | None = None,
                    healthy: bool = True) -> Iterator[GatewayProcess]:  # fmt: skip
    """`trtserve gateway` for the tritonserver on `triton_grpc_port` serving `model` (as `serve` starts it),
    or as `args` say (None, None, "--config", path)."""
    single = ["--triton-url", f"127.0.0.1:{triton_grpc_port}", "--model", model] if model else []
    command = [*single, *args]
    with GatewayProcess(command, "127.0.0.1", free_port(), api_key=api_key) as gateway:
        gateway.wait_ready(timeout_s=60, healthy=healthy)
        yield gateway
        assert gateway.process.poll() is None, "the gateway died during the tests:\n" + gateway.log_tail()


def client(gateway_url: str, api_key: str = "unused") -> openai.OpenAI:
    """No retries: a test sees the first answer (the SDK retries 429s and 5xx by default)."""
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=api_key, max_retries=0, timeout=120)


def gateway_metrics(gateway: GatewayProcess, path: str = "/metrics", api_key: str | None = None) -> dict[str, float]:
    """The gateway's series: the public page, or (path="/admin/metrics", an admin key) the per-tenant one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{gateway.url}{path}", headers=headers)
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(trtserve_gateway_\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match:
            values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return values


def build_slow_engine(engines_dir: Path) -> Path:
    """A random-weight Llama with 8192 positions: ~290 tokens/s at short context on this CPU (1,500 tokens in
    ~5 s), slowing as its context grows (8,000 tokens take ~110 s), so a long request runs until cancelled."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from builder.build import BuildOptions, build_engine
    from builder.tiny import make_tokenizer

    out = engines_dir / "slow-llama"
    if out.exists():
        return out
    checkpoint = engines_dir / "slow-llama-checkpoint"
    tokenizer = make_tokenizer()
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SLOW_MAX_SEQ_LEN,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    build_engine(BuildOptions(model=str(checkpoint), output=out, max_batch_size=4, max_seq_len=SLOW_MAX_SEQ_LEN,
                              block_size=16))  # fmt: skip
    return out


@contextlib.contextmanager
def running_servers(engine: Path, count: int, engine_params: dict[str, str] | None = None
                    ) -> Iterator[list[TritonServer]]:  # fmt: skip
    """`count` tritonservers serving `engine` on free ports, started together; each must outlive the tests."""
    servers: list[TritonServer] = []
    try:
        for _ in range(count):
            servers.append(TritonServer(ServerConfig.on_free_ports(engine, engine_params=engine_params or {})))
        for server in servers:
            server.wait_ready(timeout_s=180)
        yield servers
        for server in servers:
            assert server.process.poll() is None, "tritonserver died during the tests:\n" + server.log_tail()
    finally:
        for server in servers:  # SIGTERM to all first: they shut down side by side
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in servers:
            server.stop()


def replica_entry(server: TritonServer) -> dict[str, str]:
    """The gateway config's (and admin API's) description of a tritonserver replica."""
    config = server.config
    return {"url": f"127.0.0.1:{config.grpc_port}", "metrics_url": f"http://127.0.0.1:{config.metrics_port}/metrics"}


def engine_metrics(server: TritonServer, model: str = "llm") -> dict[str, float]:
    """Sample name -> value of `model`'s series on the server's metrics page (any name, ':' included)."""
    url = f"http://127.0.0.1:{server.config.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") == model and "finish_reason" not in sample.labels:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def admin(gateway: GatewayProcess, method: str, path: str, body: dict | None = None,
          api_key: str | None = None) -> tuple[int, dict]:  # fmt: skip
    """Call the gateway's admin API: (status, JSON body)."""
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{gateway.url}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class FreeSlot:
    """An admission slot that is always granted (what Exchange.start waits on)."""

    async def __aenter__(self) -> float:
        return 0.0

    async def __aexit__(self, *exc: object) -> None:
        return None


def stream_exchange(make: Callable[[], Exchange]) -> tuple[list[str], GatewayError | None]:
    """Run the exchange `make` builds (on the loop) to its end: its deltas' texts, and the error that ended it."""

    async def go() -> tuple[list[str], GatewayError | None]:
        exchange = make()
        await exchange.start(FreeSlot())
        texts: list[str] = []
        try:
            async for event in exchange.events():
                texts.append(event.delta.text)
        except GatewayError as exc:
            return texts, exc
        finally:
            await exchange.close()
        return texts, None

    return asyncio.run(go())

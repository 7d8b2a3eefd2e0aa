"""`trtserve serve`'s warm spare (on by default where memory holds it): a second tritonserver the gateway fails over to.

Against the real tritonserver and gateway processes: when the serving model's stub is killed, a stream under
way is resumed on the spare and a new request is answered there, without waiting for the restart; the
restarted tritonserver serves again, the spare's own death is restarted the same way, and SIGTERM drains both.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.serve.launcher import MODEL_NAME
from runtime.serve.standby import STANDBY_ENV
from tests.gateway_helpers import build_slow_engine, client, gateway_metrics
from tests.helpers import FLOAT32_BACKEND
from tests.test_gateway_restarts import LONG, assert_equal_up_to_a_near_tie
from tests.test_gateway_serve import Serve
from tests.test_hardening_server import children

pytestmark = pytest.mark.serving


def stub_of_triton(serve: Serve, grpc_port: int) -> int:
    """The `llm` stub of serve's tritonserver listening on `grpc_port`."""
    [triton] = [pid for pid, cmd in children(serve.process.pid).items() if f"--grpc-port={grpc_port} " in cmd]
    [stub] = [pid for pid, cmd in children(triton).items() if f"/models/{MODEL_NAME}/1/" in cmd]
    return stub


def test_a_dead_models_stream_and_new_requests_go_on_on_the_warm_spare(engines_dir: Path, monkeypatch):
    engine = build_slow_engine(engines_dir)
    monkeypatch.delenv(STANDBY_ENV)  # the default: a spare where memory holds one (this machine's does)
    serve = Serve(
        engine, "--health-interval", "0.5", "--backend", FLOAT32_BACKEND
    )  # float32: see test_gateway_restarts
    try:
        ready = serve.output_until("OpenAI   http", timeout_s=300)
        spare = re.search(r"standby  gRPC 127\.0\.0\.1:(\d+), HTTP", ready)
        assert spare is not None, ready
        disk_tier = re.search(r"the KV disk tier the two share: (\S+) ", ready)
        assert disk_tier is not None and Path(disk_tier.group(1)).is_dir(), ready
        serve.output_until("the standby tritonserver is ready", timeout_s=300)  # it loads once the first serves
        primary_url, spare_url = f"127.0.0.1:{serve.ports['grpc']}", f"127.0.0.1:{spare.group(1)}"
        gateway = SimpleNamespace(url=f"http://127.0.0.1:{serve.ports['openai']}")
        sdk = client(gateway.url)
        chat = {
            "model": engine.name,
            "messages": [{"role": "user", "content": "Go on."}],
            "logprobs": True,
            "top_logprobs": 2,
            **LONG,
        }
        with ThreadPoolExecutor(1) as pool:
            chunks = iter(sdk.chat.completions.create(**chat, stream=True))
            first = next(chunks).choices[0]
            rest = (lp for c in chunks if c.choices for lp in c.choices[0].logprobs.content)
            streamed = pool.submit(lambda: [*first.logprobs.content, *rest])

            os.kill(stub_of_triton(serve, serve.ports["grpc"]), signal.SIGKILL)
            answer = sdk.completions.create(
                model=engine.name, prompt="Meanwhile?", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
            )
            assert answer.usage.completion_tokens == 4
            tokens = streamed.result(timeout=300)
        metrics = gateway_metrics(gateway)  # type: ignore[arg-type]
        resumed = f'trtserve_gateway_streams_resumed_total{{backend="{engine.name}",replica="{primary_url}"}}'
        assert metrics.get(resumed) == 1
        on_spare = sum(v for k, v in metrics.items() if "replica_picks_total" in k and f'"{spare_url}"' in k)
        assert on_spare >= 2, metrics  # the resumed stream and the request sent after the kill
        # The stream went on where it was cut, on the spare: the uninterrupted greedy answer, up to a near-tie.
        reference = sdk.chat.completions.create(**chat).choices[0].logprobs.content
        assert len(tokens) == len(reference) == LONG["max_tokens"]
        assert_equal_up_to_a_near_tie(tokens, reference)

        assert "tritonserver restarted: serving again" in serve.output_until("restarted: serving again", 300)
        spare_port = int(spare.group(1))
        os.kill(stub_of_triton(serve, spare_port), signal.SIGKILL)  # the spare dies: restarted on its ports
        assert "the standby tritonserver restarted" in serve.output_until("restarted: serving again", 300)
        reply = sdk.completions.create(model=engine.name, prompt="Hi", max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert serve.stop() == 0
        stopped = serve.output_until("stopping the standby tritonserver")
        assert "stopping tritonserver" in stopped
        assert not Path(disk_tier.group(1)).exists()
    finally:
        if serve.process.poll() is None:
            serve.stop()

"""Disaggregation as a user runs it: tritonservers started with --role prefill / decode / both (the `role`
parameter `trtserve serve` writes), behind `trtserve gateway --prefill-url ... --decode-url ... --triton-url ...`.

- Greedy answers through prefill + decode equal a single `both` worker's, streamed or not, and the stream
  starts with the prefill's first token.
- Metrics: the prefill worker's handoffs and pins, the decode worker's transfers, bytes and their histogram,
  the gateway's outcomes; pins are back to 0 once read.
- A decode worker whose engine differs is refused at the handshake; the gateway recomputes on the `both` worker
  and the client gets the same answer.
- A LoRA adapter served by every worker: its answer through prefill + decode equals one worker's; a decode
  worker refuses KV computed under an adapter for a request without it.
- A prefill worker killed after answering: the decode worker's read fails with a clear error and holds no block.
- A decode worker killed before it reads: the prefill worker's pins time out; no block stays held.
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builder.build import BuildOptions, build_engine
from builder.sources import load_checkpoint, resolve_model
from runtime.serve.launcher import ServerConfig, TritonServer
from tests.gateway_helpers import client, engine_metrics, gateway_metrics, running_gateway
from tests.helpers import make_lora_adapter
from tests.triton_helpers import grpc_stream, wait_for

pytestmark = pytest.mark.serving
pytest.importorskip("nixl_cu12", reason="NIXL is the extra trtserve[disagg]")

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog " * 6, "one two three four five six seven " * 11]
MAX_TOKENS = 12


@contextlib.contextmanager
def servers(*roles: tuple) -> Iterator[list[TritonServer]]:
    started = []
    try:
        for engine, params in roles:
            started.append(TritonServer(ServerConfig.on_free_ports(engine, engine_params=params)))
        for server in started:
            server.wait_ready(timeout_s=180)
        yield started
    finally:
        for server in started:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in started:
            server.stop()


def grpc_url(server: TritonServer) -> str:
    return f"127.0.0.1:{server.config.grpc_port}"


@pytest.fixture(scope="module")
def cluster(llama_engine, tmp_path_factory):
    """Prefill, decode and both workers, each serving the LoRA adapter "qv"; gateways over the three (disagg)
    and over the `both` worker alone (plain)."""
    model = load_checkpoint(resolve_model("tiny-llama"))[0]
    adapter = make_lora_adapter(model, tmp_path_factory.mktemp("lora") / "qv", ["q_proj", "v_proj"], 8, 16, 1)
    lora = {"lora_modules": f"qv={adapter}"}
    roles = ({"role": "prefill", **lora}, {"role": "decode", **lora}, lora)
    with servers(*((llama_engine, params) for params in roles)) as (prefill, decode, both):
        args = ["--prefill-url", grpc_url(prefill), "--decode-url", grpc_url(decode), "--triton-url", grpc_url(both)]
        with (
            running_gateway(None, None, "--model", "tiny", *args) as disagg,
            running_gateway(both.config.grpc_port, "tiny") as plain,
        ):
            yield prefill, decode, both, disagg, plain


def complete(gateway, prompt: str, stream: bool = False, model: str = "tiny") -> tuple[str, int]:
    api = client(gateway.url)
    params = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        answer = api.completions.create(**params, extra_body={"ignore_eos": True})
        return answer.choices[0].text, answer.usage.completion_tokens
    chunks = list(api.completions.create(**params, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, next(c.usage.completion_tokens for c in chunks if c.usage)


def test_prefill_then_decode_answers_as_one_worker(cluster):
    prefill, decode, _, disagg, plain = cluster
    for prompt in PROMPTS:
        expected = complete(plain, prompt)
        assert expected[1] == MAX_TOKENS
        assert complete(disagg, prompt) == expected
        assert complete(disagg, prompt, stream=True) == expected
    assert wait_for(lambda: engine_metrics(prefill)["trtserve_kv_handoffs_total"] == 2 * len(PROMPTS))
    assert wait_for(lambda: engine_metrics(decode)["trtserve_kv_transfer_seconds_count"] >= len(PROMPTS))
    decode_metrics = engine_metrics(decode)
    assert decode_metrics["trtserve_kv_transfers_total"] >= len(PROMPTS)  # repeats may be whole prefix hits
    assert decode_metrics["trtserve_kv_transfer_bytes_total"] > 0
    assert decode_metrics["trtserve_kv_transfer_seconds_count"] >= len(PROMPTS)
    assert wait_for(lambda: engine_metrics(prefill)["trtserve_kv_pinned_blocks"] == 0)
    # The gauges are published every METRICS_INTERVAL_S: one taken between a read's end and its adoption lags.
    assert wait_for(lambda: engine_metrics(decode)["trtserve_kv_staged_blocks"] == 0)
    outcomes = gateway_metrics(disagg)
    assert outcomes['trtserve_gateway_disagg_requests_total{backend="tiny",outcome="decoded"}'] == 2 * len(PROMPTS)


def test_a_request_that_ends_on_its_first_token_needs_no_decode(cluster):
    _, _, _, disagg, plain = cluster
    api = client(disagg.url)
    one = api.completions.create(model="tiny", prompt="Hello there", max_tokens=1, temperature=0)
    expected = client(plain.url).completions.create(model="tiny", prompt="Hello there", max_tokens=1, temperature=0)
    assert one.choices[0].text == expected.choices[0].text and one.choices[0].finish_reason == "length"


def infer(server: TritonServer, **values):
    """One request to the decoupled `llm` model over a gRPC stream: its final (result, error)."""
    triton, results = grpc_stream(server)
    try:
        triton.async_stream_infer("llm", tensors(**values), enable_empty_final_response=False)
        return results.get(timeout=120)
    finally:
        triton.stop_stream()
        triton.close()


def prefill_handle(server: TritonServer, prompt: str, **values) -> str:
    """A prefill-only request straight to a prefill worker: its KV handle."""
    result, error = infer(server, text_input=prompt.encode(), max_tokens=MAX_TOKENS, prefill_only=True,
                          ignore_eos=True, **values)  # fmt: skip
    assert error is None, error
    assert result.as_numpy("finish_reason")[0] == b"handoff"
    return result.as_numpy("kv_handle")[0].decode()


def decode_error(server: TritonServer, prompt: str, handle: str) -> str | None:
    """A kv_handle request straight to a decode worker: its error message (None: it answered)."""
    _, error = infer(server, text_input=prompt.encode(), max_tokens=MAX_TOKENS, kv_handle=handle.encode(),
                     ignore_eos=True)  # fmt: skip
    return None if error is None else error.message()


def tensors(**values) -> list:
    out = []
    for name, value in values.items():
        kind, dtype = {bytes: ("BYTES", np.object_), bool: ("BOOL", np.bool_), int: ("INT64", np.int64)}[type(value)]
        tensor = grpcclient.InferInput(name, [1], kind)
        tensor.set_data_from_numpy(np.array([value], dtype=dtype))
        out.append(tensor)
    return out


def test_a_mismatched_decode_worker_is_refused_and_the_gateway_recomputes(cluster, engines_dir, llama_engine):
    prefill, _, both, _, plain = cluster
    other = engines_dir / "tiny-llama-block16"
    if not other.exists():
        build_engine(BuildOptions(model="tiny-llama", output=other, max_batch_size=8, max_seq_len=256, block_size=16))
    with servers((other, {"role": "decode"})) as (mismatched,):
        message = decode_error(mismatched, PROMPTS[1], prefill_handle(prefill, PROMPTS[1]))
        assert message is not None and "kv transfer failed: handshake refused: KV layout differs" in message
        assert "block_size 8, this worker 16" in message
        args = ["--prefill-url", grpc_url(prefill), "--decode-url", grpc_url(mismatched), "--triton-url",
                grpc_url(both)]  # fmt: skip
        with running_gateway(None, None, "--model", "tiny", *args) as gateway:
            assert complete(gateway, PROMPTS[1], stream=True) == complete(plain, PROMPTS[1])
            outcomes = gateway_metrics(gateway)
            assert outcomes['trtserve_gateway_disagg_requests_total{backend="tiny",outcome="recomputed"}'] == 1
        assert engine_metrics(mismatched)["trtserve_kv_cache_used_blocks"] == 0
    assert wait_for(lambda: engine_metrics(prefill)["trtserve_kv_pinned_blocks"] == 0)  # told it will not be read


def test_an_adapter_is_prefilled_and_decoded_under_itself(cluster):
    prefill, decode, _, disagg, plain = cluster
    for prompt in PROMPTS[1:]:
        expected = complete(plain, prompt, model="qv")
        assert expected != complete(plain, prompt)  # the adapter changes the answer
        assert complete(disagg, prompt, stream=True, model="qv") == expected
    message = decode_error(decode, PROMPTS[2], prefill_handle(prefill, PROMPTS[2], lora=b"qv"))
    assert message is not None and "kv_handle: the KV was computed under an adapter of digest" in message
    assert wait_for(lambda: engine_metrics(decode)["trtserve_kv_staged_blocks"] == 0)


def test_killing_the_prefill_worker_leaves_the_decode_worker_no_blocks(llama_engine):
    with servers((llama_engine, {"role": "prefill"}), (llama_engine, {"role": "decode"})) as (prefill, decode):
        handle = prefill_handle(prefill, PROMPTS[2])
        prefill.kill()
        message = decode_error(decode, PROMPTS[2], handle)
        assert message is not None and message.startswith("kv transfer failed: "), message
        assert wait_for(lambda: engine_metrics(decode)["trtserve_kv_transfer_failures_total"] == 1)  # refreshed at 2 Hz
        metrics = engine_metrics(decode)
        assert metrics["trtserve_kv_cache_used_blocks"] == 0 and metrics["trtserve_kv_staged_blocks"] == 0


def test_killing_the_decode_worker_lets_the_prefill_pins_time_out(llama_engine):
    with servers((llama_engine, {"role": "prefill", "kv_pin_timeout_s": "3"}), (llama_engine, {"role": "decode"})) as (
        prefill,
        decode,
    ):
        handle = prefill_handle(prefill, PROMPTS[2])
        pinned = len(json.loads(handle)["block_ids"])
        assert pinned > 0 and wait_for(lambda: engine_metrics(prefill)["trtserve_kv_pinned_blocks"] == pinned)
        decode.kill()  # before it could read: nobody will ever release the pins but their timeout
        assert wait_for(lambda: engine_metrics(prefill)["trtserve_kv_pinned_blocks"] == 0, timeout_s=30)
        metrics = engine_metrics(prefill)
        assert metrics["trtserve_kv_pins_expired_total"] == 1 and metrics["trtserve_kv_cache_used_blocks"] == 0

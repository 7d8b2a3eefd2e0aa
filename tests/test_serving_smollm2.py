"""SmolLM2-135M (the default real model) behind the real tritonserver binary: a chat answer
equal to HF eager greedy, and client cancellation over a gRPC stream.

Cancellation needs a request that outlives the cancel's trip (client -> Triton ->
`is_cancelled()` poll -> engine abort): 240 tokens take SmolLM2 several seconds here.
"""

from __future__ import annotations

import json

import pytest

from engine_format import EngineConfig
from runtime.engine.tokenizer import encode_prompt, stop_token_ids
from tests.helpers import hf_greedy
from tests.triton_helpers import grpc_inputs, grpc_stream, ignore_eos, metric, metrics, post, running_server, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.serving]
ABORTED = 'trtserve_request_success_total{finish_reason="abort",model="llm",version="1"}'


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with running_server(smollm2_engine) as srv:
        yield srv


def test_chat_answer_equals_hf_greedy(server, smollm2_engine, smollm2_hf):
    model, tokenizer = smollm2_hf
    question = "What is the capital of France?"
    prompt = encode_prompt(tokenizer, question, chat=True)
    want = hf_greedy(model, prompt, 24, stop_token_ids(tokenizer, EngineConfig.load(smollm2_engine)))
    messages = [{"role": "user", "content": question}]
    status, body = post(server, "/v2/models/llm/generate", {"messages": json.dumps(messages), "max_tokens": 24})
    assert status == 200, body
    assert body["text_output"] == tokenizer.decode(want, skip_special_tokens=True)
    assert body["text_output"] == "The capital of France is Paris."
    assert body["finish_reason"] == "stop"


def test_client_cancellation_aborts_and_frees_kv_blocks(server):
    before = metrics(server)
    client, results = grpc_stream(server)
    client.async_stream_infer("llm", grpc_inputs("Tell me a long story.", 240) + ignore_eos(), request_id="cancel-me")
    result, error = results.get(timeout=60)  # streaming has started: the request holds KV blocks
    assert error is None and result.as_numpy("finish_reason")[0] == b""
    client.stop_stream(cancel_requests=True)
    # Counted as "abort", not "length".
    assert wait_for(lambda: metrics(server).get(ABORTED, 0) >= before.get(ABORTED, 0) + 1), metrics(server)
    # Gauges and token counters are refreshed every 0.5 s, the finish counter at once: once the
    # blocks read 0, the token counter has been refreshed after the abort too.
    assert wait_for(lambda: metric(metrics(server), "trtserve_kv_cache_used_blocks") == 0)
    tokens = "trtserve_generation_tokens_total"
    generated = metric(metrics(server), tokens) - metric(before, tokens)
    assert 1 <= generated < 200, generated  # stopped well before its 240 tokens
    # The server goes on serving.
    status, body = post(server, "/v2/models/llm/generate", {"text_input": "Hello", "max_tokens": 4})
    assert status == 200 and body["completion_tokens"] == 4, body

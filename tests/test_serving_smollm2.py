"""SmolLM2-135M (the default real model) behind the real tritonserver binary: a chat answer
equal to HF eager greedy, and client cancellation over a gRPC stream.

The server runs with `cancel_poll_s` 0: the model asks Triton `is_cancelled()` before each
response instead of every 0.5 s, so a cancel is acted on by the next token whatever the
machine's speed. The cancelled request asks for 1,000 tokens (the engine's max_seq_len is
1,024): only a machine that makes them all within one cancel's trip could see it finish.
"""

from __future__ import annotations

import contextlib
import json
import queue

import pytest

from engine_format import EngineConfig
from runtime.engine.tokenizer import encode_prompt, stop_token_ids
from tests.helpers import FLOAT32_BACKEND, hf_greedy
from tests.triton_helpers import grpc_inputs, grpc_stream, ignore_eos, metric, metrics, post, running_server, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.serving]
FINISHED = 'trtserve_request_success_total{{finish_reason="{}",model="llm",version="1"}}'
ABORTED, LENGTH = FINISHED.format("abort"), FINISHED.format("length")
CANCELLED_MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def server(smollm2_engine):
    # float32 arithmetic: the chat answer is compared token for token with HF float32 (tests/helpers.py)
    with running_server(smollm2_engine, {"cancel_poll_s": "0", "backend": FLOAT32_BACKEND}) as srv:
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
    """Cancel once the first token has streamed (the request runs and holds KV blocks), then
    check what the engine did: it counted the request as aborted, not finished by length; it
    freed its blocks; the client got no final response."""
    before = metrics(server)
    client, results = grpc_stream(server)
    inputs = grpc_inputs("Tell me a long story.", CANCELLED_MAX_TOKENS) + ignore_eos()
    client.async_stream_infer("llm", inputs, request_id="cancel-me")
    result, error = results.get(timeout=120)  # the first streamed token
    assert error is None and result.as_numpy("finish_reason")[0] == b"", error
    client.stop_stream(cancel_requests=True)  # returns once the stream's callbacks are done
    streamed = [(result, error)]
    with contextlib.suppress(queue.Empty):
        while True:
            streamed.append(results.get_nowait())
    responses = [r for r, e in streamed if e is None]
    assert [r.as_numpy("finish_reason")[0] for r in responses] == [b""] * len(responses)
    assert responses[-1].as_numpy("completion_tokens")[0] < CANCELLED_MAX_TOKENS

    # The finish counter moves at the abort; gauges and token counters are published every
    # 0.5 s, together: a scrape with the blocks back at 0 *and* tokens counted is after the abort.
    assert wait_for(lambda: metrics(server).get(ABORTED, 0) == before.get(ABORTED, 0) + 1), metrics(server)
    tokens = "trtserve_generation_tokens_total"

    def published_after_abort() -> bool:
        now = metrics(server)
        return metric(now, "trtserve_kv_cache_used_blocks") == 0 and metric(now, tokens) > metric(before, tokens)

    assert wait_for(published_after_abort), metrics(server)
    now = metrics(server)
    assert now.get(LENGTH, 0) == before.get(LENGTH, 0)
    assert 1 <= metric(now, tokens) - metric(before, tokens) < CANCELLED_MAX_TOKENS
    # The server goes on serving.
    status, body = post(server, "/v2/models/llm/generate", {"text_input": "Hello", "max_tokens": 4})
    assert status == 200 and body["completion_tokens"] == 4, body

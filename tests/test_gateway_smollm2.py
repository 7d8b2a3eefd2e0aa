"""SmolLM2-135M (the default real model) through the OpenAI gateway and the `openai` SDK: the
chat answer equals HF eager greedy decoding, whole and streamed (served in float32: `FLOAT32_BACKEND`, as every
token-exact comparison with HF float32 is)."""

from __future__ import annotations

import pytest

from engine_format import EngineConfig
from runtime.engine.tokenizer import encode_prompt, stop_token_ids
from tests.gateway_helpers import client, running_gateway
from tests.helpers import FLOAT32_BACKEND, hf_greedy
from tests.triton_helpers import running_server

pytestmark = [pytest.mark.slow, pytest.mark.serving]
MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def sdk(smollm2_engine):
    with (
        running_server(smollm2_engine, {"backend": FLOAT32_BACKEND}) as triton,
        running_gateway(triton.config.grpc_port, MODEL) as gateway,
    ):
        yield client(gateway.url)


def test_chat_answer_equals_hf_greedy(sdk, smollm2_engine, smollm2_hf):
    model, tokenizer = smollm2_hf
    prompt = encode_prompt(tokenizer, QUESTION, chat=True)
    want_ids = hf_greedy(model, prompt, 24, stop_token_ids(tokenizer, EngineConfig.load(smollm2_engine)))
    want = tokenizer.decode(want_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": QUESTION}]
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == want == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(want_ids))
    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == want

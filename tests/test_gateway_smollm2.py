"""SmolLM2-135M (the default real model) through the OpenAI gateway and the `openai` SDK: the
chat answer equals HF eager greedy decoding, whole and streamed (served in float32: `FLOAT32_BACKEND`, as every
token-exact comparison with HF float32 is)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_format import EngineConfig
from runtime.engine.tokenizer import encode_prompt, stop_token_ids
from tests.gateway_helpers import client, running_gateway
from tests.helpers import FLOAT32_BACKEND, hf_greedy, hf_logits
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


def test_echo_scores_the_prompt_as_hf_does(sdk, smollm2_hf):
    """lm-eval's loglikelihood request through the OpenAI door: each prompt token's logprob and top alternative
    equal HF eager's log-softmax (float32 engine, 1e-3), asked twice (the second's blocks sit in the prefix cache,
    which a scored prompt does not read)."""
    model, tokenizer = smollm2_hf
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = encode_prompt(tokenizer, prompt, chat=False)
    ref = torch.log_softmax(torch.from_numpy(hf_logits(model, ids)).double(), dim=-1).numpy()
    for _ in range(2):
        reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
        logprobs = reply.choices[0].logprobs
        assert reply.usage.prompt_tokens == len(ids) and len(logprobs.token_logprobs) == len(ids) + 1
        assert logprobs.token_logprobs[0] is None
        want = [ref[i - 1, ids[i]] for i in range(1, len(ids))] + [ref[-1].max()]
        np.testing.assert_allclose(logprobs.token_logprobs[1:], want, atol=1e-3)
        best = [tokenizer.decode([int(ref[i].argmax())]) for i in range(len(ids))]
        assert [next(iter(top)) for top in logprobs.top_logprobs[1:]] == best
        assert reply.choices[0].text == prompt + " Rome"

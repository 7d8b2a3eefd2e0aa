"""EleutherAI's lm-evaluation-harness (`lm-eval` from PyPI, in a venv of its own: .ci/setup makes it) runs a
multiple-choice loglikelihood task through `trtserve serve`'s OpenAI door, as users point it at any
OpenAI-compatible server (`--model local-completions`: token-id prompts, echo + logprobs). The task is
benchmarks/lm_eval_harness.py's: 40 capitals, four choices each, from a file in the repository.

Every choice's log-likelihood the harness records equals HF eager's for the same model (float32 engine,
1e-3), computed as the harness does (the continuation's tokens are what the whole text's encoding adds to
the context's), and so does its accuracy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.lm_eval_harness import CAPITALS, context, run_harness
from tests.gateway_helpers import running_gateway
from tests.helpers import FLOAT32_BACKEND, hf_logits
from tests.triton_helpers import running_server

pytestmark = [pytest.mark.slow, pytest.mark.serving]
MODEL = "smollm2-135m"


def hf_loglikelihood(model, tokenizer, prompt: str, continuation: str) -> float:
    """The harness's split: the continuation's tokens are those the whole text's encoding adds to the prompt's."""
    whole = tokenizer.encode(prompt + continuation, add_special_tokens=False)
    start = len(tokenizer.encode(prompt, add_special_tokens=False))
    logprobs = torch.log_softmax(torch.from_numpy(hf_logits(model, whole)).double(), dim=-1).numpy()
    return float(sum(logprobs[i - 1, whole[i]] for i in range(start, len(whole))))


def test_lm_eval_loglikelihoods_equal_hf(smollm2_engine, smollm2_hf, tmp_path):
    with (
        running_server(smollm2_engine, {"backend": FLOAT32_BACKEND}) as triton,
        running_gateway(triton.config.grpc_port, MODEL) as gateway,
    ):
        run = run_harness(gateway.url, MODEL, smollm2_engine, tmp_path)
    model, tokenizer = smollm2_hf
    docs = [json.loads(line) for line in CAPITALS.read_text().splitlines()]
    assert len(run.samples) == len(docs)
    right = 0
    for doc, got in zip(docs, run.loglikelihoods(), strict=True):
        want = [hf_loglikelihood(model, tokenizer, context(doc), " " + choice) for choice in doc["choices"]]
        np.testing.assert_allclose(got, want, atol=1e-3, err_msg=doc["question"])
        right += int(np.argmax(want) == doc["answer"])
    assert run.accuracy == pytest.approx(right / len(docs))
    assert run.accuracy > 0.5  # the model knows most capitals: the scores are not noise

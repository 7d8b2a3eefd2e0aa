"""Speculative decoding on SmolLM2-135M (the default real model): greedy chat answers with n-gram
speculation are token for token those without it, on copy-heavy prompts (where drafts are accepted
often) and plain chat, with prefix caching and chunked prefill; KV is clean at the end."""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from tests.helpers import FLOAT32_BACKEND

pytestmark = pytest.mark.slow

PASSAGE = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow "
    "up to five books at a time for three weeks. Late returns cost ten cents per day."
)
PROMPTS = [
    f"Rewrite this paragraph, changing only 'nine' to 'ten':\n\n{PASSAGE}",
    f"Repeat the following text exactly:\n\n{PASSAGE}",
    "Fix the bug in this function and return the whole function:\n\n"
    "def total(items):\n    result = 0\n    for item in items:\n        result = item\n    return result\n",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]


def make_llm(engine, **args) -> LLM:
    return LLM(engine, max_num_batched_tokens=256, backend=FLOAT32_BACKEND, **args)


def test_greedy_answers_are_unchanged_by_speculation(smollm2_engine):
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = make_llm(smollm2_engine).generate(messages, params)
    llm = make_llm(smollm2_engine, speculative="ngram", num_speculative_tokens=4)
    spec = llm.generate(messages, params)
    pairs = enumerate(zip(spec, plain, strict=True))
    assert not [(i, s.text, p.text) for i, (s, p) in pairs if s.token_ids != p.token_ids]
    assert plain[3].text == "The capital of France is Paris."
    stats = llm.engine.stats()
    assert stats.spec_decode is not None and stats.spec_decode.acceptance_rate > 0.3  # copying is cheap to guess
    assert stats.kv_blocks["used"] == 0
    llm.engine.check_invariants()


def test_seeded_sampling_is_unchanged_by_speculation(smollm2_engine):
    """The verifier draws each token as the sampler does from the same stream: seeded answers agree."""
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=i, max_tokens=48) for i in range(3)]
    plain = make_llm(smollm2_engine).generate(messages, params)
    llm = make_llm(smollm2_engine, speculative="ngram", num_speculative_tokens=4)
    spec = llm.generate(messages, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert llm.engine.stats().spec_decode.accepted_tokens > 0  # type: ignore[union-attr]

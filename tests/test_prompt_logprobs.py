"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF eager, per position, in every exact backend.

A prompt's token i is scored by the log-softmax of the logits at position i - 1 (entry 0 is None), computed
from its prefill's logits: chunked prefills, a prompt whose blocks sit in the prefix cache (scored whole
anyway) and a preemption mid-prefill all give HF's numbers. Tolerance as tests/test_engine_parity.py's:
float32 on both sides, summation order only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.sources import load_checkpoint, resolve_model
from executors.sampling import SamplingParams, TokenLogprobs
from runtime.engine.engine_args import EngineArgs
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.outputs import RequestOutput
from tests.helpers import hf_logits, random_prompts

ATOL = 1e-4
TOP = 3


def hf_scores(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF eager's log-softmax [len, vocab] in float64, and each position's top-TOP ids."""
    logprobs = torch.log_softmax(torch.from_numpy(hf_logits(model, tokens)).double(), dim=-1).numpy()
    return logprobs, np.argsort(-logprobs, axis=1, kind="stable")[:, :TOP]


def assert_scores_match(scored: list[TokenLogprobs | None], model, tokens: list[int]) -> None:
    ref, top = hf_scores(model, tokens)
    assert scored[0] is None and len(scored) == len(tokens)
    for i, lp in enumerate(scored[1:], start=1):
        assert lp is not None and lp.token_id == tokens[i]
        np.testing.assert_allclose(lp.logprob, ref[i - 1, tokens[i]], atol=ATOL, err_msg=f"position {i}")
        assert [t for t, _ in lp.top] == top[i - 1].tolist(), f"position {i}"
        np.testing.assert_allclose([v for _, v in lp.top], ref[i - 1, top[i - 1]], atol=ATOL)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, RequestOutput]:
    """Each request's first output (the one carrying its prompt's scores), by request id, in prompt order."""
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, out)
    return {i: first[i] for i in ids}


@pytest.fixture(scope="module")
def tiny_hf_llama():
    return load_checkpoint(resolve_model("tiny-llama"))[0]


SCORED = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)


@pytest.mark.parametrize("kind", ["cpu", "graph", "torch"])
def test_prompt_logprobs_match_hf_in_chunked_prefills(llama_engine, tiny_hf_llama, kind):
    """Two prompts in one batch, prefilled in 16-token chunks (a chunk's every row is scored)."""
    engine = LLMEngine(llama_engine, EngineArgs(backend=kind, max_num_batched_tokens=16, itl_target_ms=None))
    prompts = random_prompts(engine.config.model.vocab_size, [37, 9], seed=5)
    outs = run(engine, prompts, SCORED)
    for prompt, out in zip(prompts, outs.values(), strict=True):
        assert out.prompt_logprobs is not None
        assert_scores_match(out.prompt_logprobs, tiny_hf_llama, prompt)
    engine.check_invariants()


def test_scores_with_speculative_decoding(llama_engine, tiny_hf_llama):
    """n-gram drafts run beside a scored prefill (a prompt that repeats itself, so drafts are proposed): the
    scores are HF's, and the tokens those of the engine without speculation."""
    args = {"backend": "cpu", "max_num_batched_tokens": 16, "itl_target_ms": None}
    prompt = random_prompts(64, [12], seed=9)[0] * 3
    params = SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=TOP, ignore_eos=True)
    tokens = {}
    for name, extra in (("spec", {"speculative": "ngram"}), ("plain", {})):
        engine = LLMEngine(llama_engine, EngineArgs(**args, **extra))
        request_id = engine.add_request(prompt, params)
        tokens[name], scored = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[name] += out.token_ids
                scored = scored or out.prompt_logprobs
        assert scored is not None and request_id
        assert_scores_match(scored, tiny_hf_llama, prompt)
    assert tokens["spec"] == tokens["plain"] and len(tokens["spec"]) == 10


def test_the_check_catches_scores_one_position_off(llama_engine, tiny_hf_llama):
    engine = LLMEngine(llama_engine, EngineArgs(backend="cpu", itl_target_ms=None))
    prompt = random_prompts(engine.config.model.vocab_size, [20], seed=6)[0]
    scored = next(iter(run(engine, [prompt], SCORED).values())).prompt_logprobs
    assert scored is not None
    shifted = [None, *scored[2:], scored[1]]
    with pytest.raises(AssertionError):
        assert_scores_match(shifted, tiny_hf_llama, prompt)


def test_cached_prompt_is_scored_whole(llama_engine, tiny_hf_llama):
    """A prompt whose blocks the prefix cache holds is still computed from its first token (the cache has no
    logits), and the blocks it computes are cached for the others."""
    engine = LLMEngine(llama_engine, EngineArgs(backend="cpu", itl_target_ms=None))
    prompt = random_prompts(engine.config.model.vocab_size, [41], seed=7)[0]
    run(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))  # caches its 5 full blocks
    hits = engine.kv.prefix_hits
    out = next(iter(run(engine, [prompt], SCORED).values()))
    assert engine.kv.prefix_hits == hits  # no hit taken
    assert out.prompt_logprobs is not None
    assert_scores_match(out.prompt_logprobs, tiny_hf_llama, prompt)
    run(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))
    assert engine.kv.prefix_hits > hits  # a request without them still hits


def test_preempted_prefill_keeps_its_scores(llama_engine, tiny_hf_llama):
    """Too few KV blocks for both prompts: one is preempted mid-prefill and recomputed; its scores are still
    one per prompt token, equal to HF's."""
    engine = LLMEngine(
        llama_engine, EngineArgs(backend="cpu", num_kv_blocks=10, max_num_batched_tokens=16, itl_target_ms=None)
    )
    prompts = random_prompts(engine.config.model.vocab_size, [60, 60], seed=8)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=TOP, ignore_eos=True)
    outs = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs.values(), strict=True):
        assert out.prompt_logprobs is not None
        assert_scores_match(out.prompt_logprobs, tiny_hf_llama, prompt)


def test_texts_and_no_scores_unless_asked(llama_engine):
    engine = LLMEngine(llama_engine, EngineArgs(backend="cpu", itl_target_ms=None))
    prompt = engine.tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    plain = next(iter(run(engine, [prompt], SamplingParams(temperature=0, max_tokens=2)).values()))
    assert plain.prompt_logprobs is None
    scored = next(iter(run(engine, [prompt], SCORED).values())).prompt_logprobs
    assert scored is not None
    pieces = [lp.texts[lp.token_id] for lp in scored[1:] if lp is not None]
    assert engine.tokenizer.decode(prompt[:1]) + "".join(pieces) == engine.tokenizer.decode(prompt)
    assert all(len(lp.texts) >= 1 for lp in scored[1:] if lp is not None)

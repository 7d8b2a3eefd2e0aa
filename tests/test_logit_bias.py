"""logit_bias: -100 bans a token, +100 forces it, in both samplers (the engine's numpy sampler and the torch
backend's device sampler), with speculative decoding and with a grammar; bad biases are refused naming the field."""

from __future__ import annotations

import pytest

from engine_format.requests import InvalidRequest
from executors.sampling import SamplingParams
from runtime.engine.engine_args import EngineArgs
from runtime.engine.llm_engine import LLMEngine
from runtime.llm import LLM

PROMPT = [30, 31, 32, 33]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module", params=["cpu", "torch"])
def llm(request, llama_engine) -> LLM:
    return LLM(llama_engine, backend=request.param, itl_target_ms=None)


def generate(llm: LLM, **params) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(**{**GREEDY, **params}))[0].token_ids


def test_minus_100_bans_and_plus_100_forces(llm):
    plain = generate(llm)
    banned = set(plain)
    without = generate(llm, logit_bias=dict.fromkeys(banned, -100.0))
    assert not banned & set(without)
    assert generate(llm, logit_bias={77: 100.0}) == [77] * 8
    assert generate(llm) == plain  # nothing kept from the biased requests


def test_bias_reaches_logprobs_and_sampled_rows(llm):
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=1, logit_bias={77: 100.0}, ignore_eos=True),
    )[0]
    assert out.token_ids == [77] * 6
    assert all(lp.logprob > -1e-3 for lp in out.logprobs)  # +100: all the probability


def test_bias_with_speculative_decoding(llama_engine):
    llm = LLM(llama_engine, backend="cpu", speculative="ngram", itl_target_ms=None)
    repeated = PROMPT * 4  # n-gram drafts propose continuations of the repetition
    plain = llm.generate([repeated], SamplingParams(**GREEDY))[0].token_ids
    biased = llm.generate([repeated], SamplingParams(**GREEDY, logit_bias={plain[0]: -100.0}))[0].token_ids
    assert plain[0] not in biased
    assert llm.generate([repeated], SamplingParams(**GREEDY, logit_bias={77: 100.0}))[0].token_ids == [77] * 8


def test_bias_with_a_grammar_chooses_among_what_it_allows(llama_engine):
    llm = LLM(llama_engine, backend="cpu", itl_target_ms=None)
    tokenizer = llm.tokenizer
    choices = ("yes", "no")
    first = {c: tokenizer.encode(c, add_special_tokens=False)[0] for c in choices}
    params = {"temperature": 0.0, "max_tokens": 8, "guided_choice": choices}
    for banned, want in (("yes", "no"), ("no", "yes")):
        out = llm.generate(["Answer:"], SamplingParams(**params, logit_bias={first[banned]: -100.0}))[0]
        assert out.text == want
    # a bias toward a token the grammar refuses cannot force it
    assert llm.generate(["Answer:"], SamplingParams(**params, logit_bias={77: 100.0}))[0].text in choices


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({5: 100.5}, "values must be in [-100, 100]"),
        ({"x": 1.0}, "keys must be token ids"),
        ({-3: 1.0}, "keys must be token ids"),
        ({5: float("nan")}, "finite numbers"),
        (dict.fromkeys(range(1025), 1.0), "limit is 1024"),
        ([5], "must be an object"),
    ],
)
def test_bad_biases_name_the_field(bias, says):
    with pytest.raises(InvalidRequest, match=r"^logit_bias: .*" + says.replace("[", r"\[").replace("]", r"\]")) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.field == "logit_bias"


def test_an_id_past_the_vocabulary_is_refused_at_admission(llama_engine):
    engine = LLMEngine(llama_engine, EngineArgs(backend="cpu"))
    vocab = engine.config.model.vocab_size
    with pytest.raises(InvalidRequest, match=f"token id {vocab} outside the vocabulary") as e:
        engine.add_request(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.field == "logit_bias" and not engine.has_unfinished_requests()

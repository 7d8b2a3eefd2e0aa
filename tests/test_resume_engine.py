"""Resuming a cut stream in the engine (`resume_token_ids`): a request given the first k tokens of an answer goes
on exactly as the uninterrupted request did (greedy, seeded sampling, penalties, a grammar), counts them as
output without sending them again, and its text continues the answer's. Bad resumptions are refused by name."""

from __future__ import annotations

import pytest

from engine_format.requests import InvalidRequest
from runtime import LLM, SamplingParams
from runtime.engine.outputs import CompletionOutput

PROMPT = "The quick brown fox"
CUT = 9


@pytest.fixture(scope="module")
def llm(llama_engine) -> LLM:
    return LLM(llama_engine)


def resumed(llm: LLM, params: SamplingParams, answer: list[int]) -> tuple[CompletionOutput, int]:
    """The resumed request's output and its last count of output tokens."""
    engine = llm.engine
    request_id = engine.add_request(PROMPT, params, resume_token_ids=answer)
    out = CompletionOutput(request_id, [])
    while out.finish_reason is None:
        for delta in engine.step():
            if delta.request_id == request_id:
                out.add(delta)
                counted = delta.num_output_tokens
    return out, counted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=24, guided_regex="[a-z]{3}( [a-z]{2,4}){12}"),
    ],
    ids=["greedy", "seeded", "penalties", "grammar"],
)  # fmt: skip
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(llm, params):
    whole = llm.generate(PROMPT, params)[0]
    assert len(whole.token_ids) > CUT
    rest, counted = resumed(llm, params, whole.token_ids[:CUT])
    assert rest.token_ids == whole.token_ids[CUT:] and rest.finish_reason == whole.finish_reason
    assert counted == len(whole.token_ids)  # the resumed tokens count as output
    head = llm.tokenizer.decode(whole.token_ids[:CUT])
    assert head + rest.text == whole.text  # the text continues the answer's (nothing sent twice)
    assert llm.engine.kv.pool.counts()["used"] == 0


def test_the_resumed_tokens_are_the_context_a_changed_one_changes_what_follows(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    answer = llm.generate(PROMPT, params)[0].token_ids
    changed = [*answer[: CUT - 1], (answer[CUT - 1] + 1) % 200]
    assert resumed(llm, params, changed)[0].token_ids != answer[CUT:]


@pytest.mark.parametrize(
    ("resume", "says"),
    [(list(range(5, 29)), "max_tokens"), ([5, 2, 7], "stop token"), ([5, 10**6], "outside the vocabulary")],
)
def test_a_resumption_that_could_not_have_happened_is_refused(llm, resume, says):
    with pytest.raises(InvalidRequest) as err:
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=24), resume_token_ids=resume)
    assert err.value.field == "resume_token_ids" and says in str(err.value)
    assert not llm.engine.requests

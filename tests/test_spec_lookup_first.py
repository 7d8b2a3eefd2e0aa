"""The `draft` method's prompt lookup first: a request whose text ends in a repeat of at least
draft_prompt_lookup_min tokens takes the lookup's guess and costs the draft model nothing; the others
run the draft model. Greedy output stays the plain greedy loop's; the draft catches up on what lookup
guesses were accepted; everything is released at the end."""

from __future__ import annotations

import pytest

from engine_format import EngineConfig
from executors import create_backend
from runtime import EngineArgs, LLMEngine, SamplingParams
from runtime.engine.spec import DraftEngineProposer
from runtime.engine.spec.lookup_first import LookupFirstProposer
from runtime.engine.spec.ngram import NgramProposer
from tests.helpers import random_prompts
from tests.test_spec_decode import copy_heavy_prompts, run
from tests.test_spec_draft import Recording, draft_args, mistral_engine, reference  # noqa: F401 - fixtures


@pytest.fixture
def recorded(llama_engine):
    backend = Recording(create_backend(EngineConfig.load(llama_engine), num_blocks=16, kind="graph"))
    return backend, LookupFirstProposer(NgramProposer(3, 4), DraftEngineProposer(backend))


def test_a_repeat_of_three_tokens_is_proposed_by_lookup_without_the_draft_model(recorded):
    backend, proposer = recorded
    text = [*range(10, 30), 10, 11, 12]  # ends in 10 11 12, seen at the start: 13 14 15 followed it
    assert proposer.propose([text], [3], ["r"]) == [[13, 14, 15]]
    assert backend.steps == [] and proposer.caught_up == 0
    assert (proposer.lookup_proposals, proposer.draft_proposals) == (1, 0)


def test_a_shorter_repeat_runs_the_draft_model(recorded):
    backend, proposer = recorded
    text = [*range(10, 30), 99, 11, 12]  # only 11 12 repeats: two tokens, under the minimum of three
    (drafts,) = proposer.propose([text], [3], ["r"])
    assert len(drafts) == 3
    assert backend.steps[0] == [(text, 0, [0, 1, 2])]  # the draft model prefilled the text (8-token blocks)
    assert proposer.caught_up == len(text) and (proposer.lookup_proposals, proposer.draft_proposals) == (0, 1)


def test_a_batch_splits_by_source_and_the_draft_catches_up_later(recorded):
    backend, proposer = recorded
    plain, repeating = list(range(40, 52)), [*range(10, 30), 10, 11, 12]
    out = proposer.propose([plain, repeating], [2, 2], ["a", "b"])
    assert out[1] == [13, 14] and len(out[0]) == 2
    assert all(len(step) == 1 and step[0][0][0] in (40, out[0][0]) for step in backend.steps)  # only "a" ran
    # "b" loses its repeat (the target rejected the guess and added 7): the draft model prefills all of it.
    backend.steps.clear()
    later = [*repeating, 7]
    proposer.propose([later], [2], ["b"])
    assert backend.steps[0] == [(later, 0, [2, 3, 4])]  # blocks after "a"'s 0 and 1
    for request in ("a", "b"):
        proposer.release(request)
    assert sorted(proposer.draft.runner.free) == list(range(16))  # type: ignore[attr-defined]


def test_greedy_tokens_are_unchanged_and_both_sources_propose(llama_engine, mistral_engine, reference):  # noqa: F811
    engine = LLMEngine(llama_engine, draft_args(mistral_engine, draft_prompt_lookup_min=3))
    prompts = copy_heavy_prompts(488, [24, 30], seed=3) + random_prompts(488, [17], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert run(engine, prompts, params) == [reference(p, 24) for p in prompts]
    assert engine.spec is not None
    proposer = engine.spec.proposer
    assert isinstance(proposer, LookupFirstProposer)
    assert proposer.lookup_proposals > 0 and proposer.draft_proposals > 0
    draft = proposer.draft
    assert isinstance(draft, DraftEngineProposer)
    assert not draft.runner.sequences and len(draft.runner.free) == draft.backend.num_blocks  # all released


def test_the_default_is_lookup_first_and_zero_turns_it_off(llama_engine):
    args = dict(speculative="draft", draft_engine=str(llama_engine))
    assert isinstance(LLMEngine(llama_engine, EngineArgs(**args)).spec.proposer, LookupFirstProposer)  # type: ignore[union-attr]
    alone = LLMEngine(llama_engine, EngineArgs(**args, draft_prompt_lookup_min=0)).spec
    assert alone is not None and isinstance(alone.proposer, DraftEngineProposer)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_lookup_minimum_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="draft_prompt_lookup_min must be an integer >= 0"):
        EngineArgs(draft_prompt_lookup_min=value)

"""Structured output in the samplers, without an engine: the bitmask reaches exactly the grammar rows, the
numpy and torch samplers choose the same tokens under it (greedy, seeded, penalized, with logprobs), the
matcher moves only on kept tokens, and speculative verification masks each draft position and leaves the
matcher where it was, rejecting drafts the grammar refuses. Real llguidance matchers over the tiny
test tokenizer (builder/tiny.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from builder.tiny import make_tokenizer
from engine_format.grammars import GrammarSpec, guided_spec, llguidance_grammar
from executors.sampling import Sampler, SamplingParams, SamplingState
from executors.sampling.grammar import GrammarState, allowed, mask_logits
from executors.sampling.torch_sampler import TorchSampler
from runtime.engine.spec.rejection_sampler import RejectionSampler

TOKENIZER = make_tokenizer()
VOCAB = len(TOKENIZER) + 8  # logits wider than the tokenizer, as models pad their vocabulary
EOS = 2
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"]}  # fmt: skip


@pytest.fixture(scope="module")
def llg_tokenizer():
    import llguidance.hf

    return llguidance.hf.from_tokenizer(TOKENIZER, n_vocab=VOCAB, eos_token=[EOS])


def grammar(llg_tokenizer, **guided) -> GrammarState:
    from llguidance import LLMatcher

    spec = guided_spec(guided)
    assert spec is not None
    matcher = LLMatcher(llg_tokenizer, llguidance_grammar(spec))
    assert not matcher.is_error(), matcher.get_error()
    return GrammarState(matcher, VOCAB, [EOS])


def state(llg_tokenizer, params: SamplingParams, prompt=(5, 6, 7)) -> SamplingState:
    spec = params.grammar
    g = None if spec is None else grammar(llg_tokenizer, **{spec.field: getattr(params, spec.field)})
    return SamplingState(params, list(prompt), VOCAB, g)


def tokens_text(ids: list[int]) -> str:
    return TOKENIZER.decode([t for t in ids if t != EOS])


def test_the_mask_reaches_only_grammar_rows_and_only_refused_tokens(llg_tokenizer):
    logits = np.random.default_rng(0).normal(size=(3, VOCAB)).astype(np.float32)
    choice = SamplingParams(temperature=0, guided_choice=["yes", "no"])
    states = [state(llg_tokenizer, SamplingParams(temperature=0)), state(llg_tokenizer, choice),
              state(llg_tokenizer, SamplingParams(temperature=0))]  # fmt: skip
    masked = mask_logits(logits, states)
    np.testing.assert_array_equal(masked[[0, 2]], logits[[0, 2]])
    ok = allowed(states[1].grammar.mask()[None], VOCAB)[0]
    assert 0 < ok.sum() < 10 and not ok[len(TOKENIZER) :].any()  # no padding token is ever allowed
    assert np.isneginf(masked[1, ~ok]).all()
    np.testing.assert_array_equal(masked[1, ok], logits[1, ok])
    for token in np.flatnonzero(ok):  # every allowed token starts one of the choices
        assert any(c.startswith(TOKENIZER.decode([token])) for c in ("yes", "no"))
    plain = [s for i, s in enumerate(states) if i != 1]
    assert mask_logits(logits[[0, 2]], plain) is not None
    untouched = logits[[0, 2]]
    assert mask_logits(untouched, plain) is untouched  # no grammar in the batch: not even a copy


CASES = {
    "greedy": SamplingParams(temperature=0, guided_json=json.dumps(SCHEMA)),
    "seeded": SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11, guided_json=json.dumps(SCHEMA)),
    "penalized+logprobs": SamplingParams(
        temperature=0.7,
        seed=3,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        logprobs=3,
        guided_regex=r"[a-z]{2,6}-[0-9]{1,3}",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_numpy_and_torch_samplers_choose_the_same_tokens_under_a_grammar(llg_tokenizer, case):
    params = CASES[case]
    rng = np.random.default_rng(7)
    host = [state(llg_tokenizer, params), state(llg_tokenizer, SamplingParams(temperature=0.5, seed=1))]
    device = [state(llg_tokenizer, params), state(llg_tokenizer, SamplingParams(temperature=0.5, seed=1))]
    sampler, torch_sampler = Sampler(), TorchSampler(torch.device("cpu"))
    out: list[int] = []
    for _ in range(40):
        logits = (rng.normal(size=(2, VOCAB)) * 3).astype(np.float32)
        a = sampler.sample(logits, host)
        b = torch_sampler.sample(torch.from_numpy(logits), device)
        assert a.token_ids.tolist() == b.token_ids.tolist()
        if params.logprobs is not None:
            assert a.logprobs[0].top[0][0] == b.logprobs[0].top[0][0]
            assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=1e-5)
        for s in (*host, *device):
            s.append(int(a.token_ids[host.index(s)] if s in host else b.token_ids[device.index(s)]))
        out.append(int(a.token_ids[0]))
        if out[-1] == EOS:
            break
    assert out[-1] == EOS, "the grammar completes and then allows only EOS"
    text = tokens_text(out)
    if params.guided_json:
        value = json.loads(text)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 999
    else:
        assert re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", text)
    assert host[0].grammar.num_accepted == device[0].grammar.num_accepted == len(out)


def test_the_matcher_moves_only_on_kept_tokens(llg_tokenizer):
    s = state(llg_tokenizer, SamplingParams(temperature=0, guided_choice=["yes", "no"]))
    before = s.grammar.mask()
    for _ in range(3):  # sampling alone (e.g. a verify row that is then rejected) does not advance it
        Sampler().sample(np.zeros((1, VOCAB), np.float32), [s])
    np.testing.assert_array_equal(s.grammar.mask(), before)
    s.append(TOKENIZER.encode("no")[0])
    assert s.grammar.num_accepted == 1 and not np.array_equal(s.grammar.mask(), before)


def test_a_refused_kept_token_ends_the_request(llg_tokenizer):
    """A token no mask allowed (a sampler that skipped it) is counted, and only EOS is allowed afterwards."""
    s = state(llg_tokenizer, SamplingParams(temperature=0, guided_regex="[0-9]+"))
    s.append(TOKENIZER.encode("abc")[0])
    assert s.grammar.counters.violations == 1
    assert np.flatnonzero(allowed(s.grammar.mask()[None], VOCAB)[0]).tolist() == [EOS]


def digits(text: str) -> list[int]:
    ids = TOKENIZER.encode(text)
    assert TOKENIZER.decode(ids) == text
    return ids


def test_draft_masks_follow_the_drafts_and_roll_back(llg_tokenizer):
    s = state(llg_tokenizer, SamplingParams(temperature=0, guided_regex="[0-9]{6}"))
    s.append(digits("1")[0])
    before = s.grammar.mask()
    good, bad = digits("2")[0], TOKENIZER.encode("x")[0]
    masks = s.grammar.draft_masks([good, good, bad, good])
    assert masks.shape[0] == 5
    np.testing.assert_array_equal(masks[0], before)
    ok = allowed(masks, VOCAB)
    assert ok[0, good] and ok[1, good] and ok[2, good] and not ok[2, bad]
    assert (masks[3:] == -1).all()  # past the refused draft: never reached by verification
    np.testing.assert_array_equal(s.grammar.mask(), before)  # rolled back
    assert s.grammar.valid_prefix([good, good, bad, good]) == 2
    np.testing.assert_array_equal(s.grammar.mask(), before)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verification_rejects_drafts_the_grammar_refuses(llg_tokenizer, temperature):
    """The target's logits favour each draft overwhelmingly, the refused one too: the drafts before it are
    accepted, it is rejected, the emitted token is one the grammar allows, and the matcher is untouched
    until the kept tokens are appended."""
    s = state(llg_tokenizer, SamplingParams(temperature=temperature, seed=5, guided_regex="[0-9]{6}"))
    d1, d2, bad = digits("3")[0], digits("4")[0], TOKENIZER.encode("x")[0]
    drafts = [d1, d2, bad]
    logits = np.zeros((4, VOCAB), np.float32)
    for row, token in enumerate([*drafts, bad]):
        logits[row, token] = 50.0
    before = s.grammar.mask()
    result = RejectionSampler().verify(logits, [drafts], [s])
    assert result.num_accepted.tolist() == [2]
    emitted = result.token_ids[0]
    assert emitted[:2] == [d1, d2] and emitted[2] != bad
    np.testing.assert_array_equal(s.grammar.mask(), before)
    for token in emitted:
        s.append(token)
    assert s.grammar.counters.violations == 0 and s.grammar.num_accepted == 3
    assert re.fullmatch("[0-9]+", tokens_text(emitted))


def test_a_spec_key_is_the_grammar_not_the_request():
    a, b = GrammarSpec("guided_json", '{"type": "object"}'), GrammarSpec("guided_json", '{"type": "object"}')
    assert a.key == b.key != GrammarSpec("guided_regex", '{"type": "object"}').key

"""The speculation governor: measures steps with and without drafts per batch size and runs the
cheaper mode, probing the other. Model-free (exact decisions from injected step times), then on a
tiny engine with a clock that charges each step by its tokens and drafts that are always rejected."""

from __future__ import annotations

import pytest

from runtime import EngineArgs, LLMEngine, SamplingParams
from runtime.engine.spec.governor import SpeculationGovernor
from tests.helpers import random_prompts


def drive(governor: SpeculationGovernor, batch: int, steps: int, spec_s: float, plain_s: float) -> list[bool]:
    """`steps` decode steps of `batch` requests, one token each when plain, 2 when drafted; returns the modes."""
    modes = []
    for _ in range(steps):
        speculate = governor.speculate(batch)
        modes.append(speculate)
        governor.observe(batch, speculate, spec_s if speculate else plain_s, 2 * batch if speculate else batch)
    return modes


def test_it_measures_both_modes_then_runs_the_cheaper_and_probes_the_other():
    governor = SpeculationGovernor(period=16, probe_steps=2)
    # Drafted steps take 0.05 s for 2 tokens (25 ms each); plain 0.02 s for 1: plain is cheaper.
    modes = drive(governor, 1, 60, spec_s=0.05, plain_s=0.02)
    assert modes[:4] == [True, True, False, False]  # each mode measured probe_steps times, drafts first
    # Judged at step 4: plain runs, drafts are probed 16 steps on (20, 21); that probe confirms plain,
    # so the next one waits 32 steps (54, 55), then 64.
    assert [i for i, m in enumerate(modes) if m] == [0, 1, 20, 21, 54, 55]


def test_speculation_that_pays_keeps_running_and_plain_is_probed():
    governor = SpeculationGovernor(period=16, probe_steps=2)
    modes = drive(governor, 1, 60, spec_s=0.03, plain_s=0.02)  # drafted: 15 ms per token
    assert [i for i, m in enumerate(modes) if not m] == [2, 3, 20, 21, 54, 55]


def test_batch_sizes_are_judged_apart_and_a_change_is_noticed():
    governor = SpeculationGovernor(period=8, probe_steps=2)
    drive(governor, 1, 14, spec_s=0.01, plain_s=0.02)  # pays at batch 1 (step 14: no probe due)
    drive(governor, 4, 14, spec_s=0.2, plain_s=0.02)  # not at batch 4
    assert governor.speculate(1) and not governor.speculate(4)
    # Drafts stop paying at batch 1 (e.g. the content no longer copies): the probes of plain see it.
    modes = drive(governor, 1, 60, spec_s=0.1, plain_s=0.02)
    # A few drafted steps at 50 ms a token lift the average past plain's 20: plain from then on, with
    # probes of drafts 8 steps on, then 16 (the wait doubles as each probe confirms plain).
    assert "".join("S" if m else "." for m in modes) == "SSSSSS" + "." * 8 + "SS" + "." * 16 + "SS" + "." * 26


def test_a_mode_s_cost_is_a_ratio_of_sums_not_a_mean_of_per_step_ratios():
    """Drafted steps of 30 ms alternate 1 and 5 emitted tokens: 10 ms per token, cheaper than plain 15 ms.
    Averaging per-step ratios (30 and 6 ms) would say 18 ms and turn speculation off."""
    governor = SpeculationGovernor(period=16, probe_steps=2)
    modes = []
    for step in range(60):
        speculate = governor.speculate(1)
        modes.append(speculate)
        governor.observe(1, speculate, 0.03 if speculate else 0.015, (1 if step % 2 else 5) if speculate else 1)
    assert governor.costs[1].speculating.s_per_token < governor.costs[1].plain.s_per_token
    assert [i for i, m in enumerate(modes) if not m] == [2, 3, 20, 21, 54, 55]


def test_steps_that_measured_nothing_are_ignored():
    governor = SpeculationGovernor(period=8, probe_steps=2)
    for _ in range(10):
        governor.observe(1, True, 0.0, 2)  # a clock that did not move
        governor.observe(1, True, 0.1, 0)  # nothing emitted (every request aborted)
    assert governor.speculate(1) and governor.costs[1].speculating.samples == 0


def test_bad_settings_are_refused():
    for period, probe_steps, max_period in ((4, 4, 8), (8, 2, 4), (8, 0, 8)):
        with pytest.raises(ValueError, match="probe_steps"):
            SpeculationGovernor(period, probe_steps, max_period)


class TokenClock:
    """Seconds advance only when the backend runs: 10 ms per token computed (so a verify chunk of
    k + 1 tokens costs k + 1 decodes, as on a compute-bound CPU)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_drafts_that_never_pay_are_turned_off_on_a_tiny_engine(llama_engine):
    clock = TokenClock()
    args = EngineArgs(speculative="ngram", num_speculative_tokens=4, itl_target_ms=None)
    engine = LLMEngine(llama_engine, args, clock=clock)
    step = engine.backend.step

    def charged(chunks):
        clock.now += 0.01 * sum(len(c.token_ids) for c in chunks)
        return step(chunks)

    engine.backend.step = charged  # type: ignore[method-assign]
    assert engine.spec is not None
    # A proposer whose drafts are always wrong: every verify pass costs 5 tokens and emits 1.
    vocab = engine.config.model.vocab_size
    engine.spec.proposer.propose = lambda contexts, ks, *_: [
        [(c[-1] + 1) % vocab] * k for c, k in zip(contexts, ks, strict=True)
    ]
    prompt = random_prompts(vocab, [6], seed=3)[0]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    drafted_steps = []
    while engine.has_unfinished_requests():
        before = engine.stats().spec_decode.drafts  # type: ignore[union-attr]
        engine.step()
        drafted_steps.append(engine.stats().spec_decode.drafts > before)  # type: ignore[union-attr]
    governor = engine.spec.governor
    spec_ms, plain_ms = (1000 * m.s_per_token for m in (governor.costs[1].speculating, governor.costs[1].plain))
    assert plain_ms == pytest.approx(10) and spec_ms > 2 * plain_ms  # ~50: 5 tokens computed, ~1 emitted
    # Drafted: the measuring steps (4) and one probe (4 steps, 64 steps on); without the governor, all ~120.
    assert 8 <= sum(drafted_steps) <= 12
    engine.check_invariants()


def test_a_draft_engine_s_one_off_catch_up_is_not_judged_as_the_cost_of_speculating(llama_engine):
    """The draft prefills a new prompt in the step before the first verify: that switching price would make
    drafting look ~3x dearer per token than it is in steady state (what turned a paying INT4 draft off)."""
    clock = TokenClock()
    args = EngineArgs(speculative="draft", draft_engine=str(llama_engine), num_speculative_tokens=3,
                      itl_target_ms=None, draft_prompt_lookup_min=0)  # fmt: skip
    engine = LLMEngine(llama_engine, args, clock=clock)
    assert engine.spec is not None and engine.spec.governor is not None
    for backend in (engine.backend, engine.spec.proposer.backend):  # type: ignore[attr-defined]
        step = backend.step
        backend.step = lambda chunks, step=step: (setattr(clock, "now", clock.now + 0.01 * sum(len(c.token_ids) for c in chunks)), step(chunks))[1]  # fmt: skip  # noqa: E501
    prompt = random_prompts(engine.config.model.vocab_size, [60], seed=5)[0]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats().spec_decode
    assert stats is not None and stats.acceptance_rate == 1.0  # the target as its own draft
    # Steady drafted step: the draft catches up on its last draft and the target's token (2), drafts twice
    # more (2), the verify runs 4 tokens: 8 tokens of work for 4 emitted. Counting the 60-token prompt
    # catch-up as well makes it ~0.05 per token.
    assert engine.spec.governor.costs[1].speculating.s_per_token == pytest.approx(0.01 * 8 / 4)

"""The step cost model, the ITL budget and TTFT targets on the tiny engine: step times charged
through the engine's injected clock (deterministic), and one real-clock run with a loose bound."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import EngineArgs, InvalidRequest, LLMEngine, Overloaded, SamplingParams
from runtime.engine.step_cost import OnlineStepCost, StepCost, StepShape
from tests.helpers import random_prompts, run_with_arrivals
from tests.test_llm_engine import FakeClock

# Synthetic step costs (seconds) the fake backend clock charges: unlike the prior on every term.
SYNTHETIC = StepCost(base_s=0.004, prefill_token_s=0.0003, decode_seq_s=0.0015, kilo_pair_s=0.002)


def charge_steps(engine: LLMEngine, clock: FakeClock, cost: StepCost = SYNTHETIC) -> None:
    """Each backend step advances the clock by `cost` of its chunks: the engine's step times are exact."""
    real_step = engine.backend.step

    def step(chunks):
        clock.advance(cost.predict(StepShape.of((len(c.token_ids), c.past_len) for c in chunks)))
        return real_step(chunks)

    engine.backend.step = step


def test_the_engine_learns_its_step_cost_and_keeps_steps_within_the_itl_target(llama_engine):
    """24 staggered requests on the tiny engine, each step's time charged from SYNTHETIC through
    the engine's clock. From the prior (6x too slow a base, 4x too cheap attention) the model
    predicts every step within 1% after 30 steps and its coefficients end within 1%; from then on
    every step that decodes stays within the 25 ms target (+1%), with prefill cut to fit."""
    clock = FakeClock()
    args = EngineArgs(max_num_batched_tokens=128, itl_target_ms=25, min_prefill_tokens=8)
    engine = LLMEngine(llama_engine, args, clock=clock)
    charge_steps(engine, clock)
    rng = np.random.default_rng(6)
    prompts = random_prompts(engine.config.model.vocab_size, rng.integers(5, 200, 24).tolist(), seed=7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    run_with_arrivals(engine, prompts, params, sorted(rng.integers(0, 200, 24).tolist()))
    records = engine.take_step_records()
    stats = engine.stats()
    assert len(records) == stats.steps > 200 and engine.take_step_records() == []
    assert max(abs(r.predicted_s / r.seconds - 1) for r in records[30:]) < 0.01
    learned, truth = engine.cost_model.coefficients.as_array(), SYNTHETIC.as_array()
    assert (abs(learned / truth - 1) < 0.01).all()
    decoding = [r for r in records[30:] if r.decode_seqs]
    assert max(r.seconds for r in decoding) <= 0.025 * 1.01
    assert any(0 < r.prefill_tokens < 128 - r.decode_seqs for r in decoding)  # the target cut prefill
    assert stats.step_time_s.count == stats.prefill_tokens_per_step.count == stats.steps
    assert stats.step_time_s.total == pytest.approx(sum(r.seconds for r in records))
    # Every token after a request's first is one inter-token latency against the 25 ms target.
    assert stats.slo["itl_met"] + stats.slo.get("itl_missed", 0) == stats.generation_tokens - len(prompts)
    assert stats.step_cost == engine.cost_model.coefficients and stats.itl_target_s == 0.025


def test_ttft_targets_order_admit_and_reject_and_are_counted(llama_engine):
    """One sequence slot; each step is charged 10 ms + 1 ms per prefill token (the model's prior
    too, so learning keeps it). A request whose TTFT target the prefill ahead cannot meet is
    rejected at once with a retry hint; an earlier deadline overtakes an earlier arrival; first
    tokens are counted against their targets."""
    clock = FakeClock()
    costs = StepCost(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.0, kilo_pair_s=0.0)
    engine = LLMEngine(llama_engine, EngineArgs(max_num_batched_tokens=64, max_num_seqs=1), clock=clock,
                       cost_model=OnlineStepCost(costs))  # fmt: skip
    charge_steps(engine, clock, costs)
    first = engine.add_request(list(range(3, 103)), SamplingParams(temperature=0, max_tokens=2))  # no target
    engine.step()  # first prefills 64 of its 100 tokens (74 ms)
    # 36 ahead + 20 own = 56 tokens at full speed: 66 ms > 50 ms.
    with pytest.raises(Overloaded, match=r"^overloaded: ttft_target_s 0.05 cannot be met: 36 prompt tokens") as info:
        engine.add_request(list(range(200, 220)), SamplingParams(max_tokens=2, ttft_target_s=0.05))
    assert info.value.reason == "slo" and info.value.retry_after_s == pytest.approx(0.016)
    with pytest.raises(InvalidRequest, match="less than this prompt's prefill alone"):  # 30 ms > 20 ms, nothing ahead
        engine.add_request(list(range(200, 220)), SamplingParams(max_tokens=2, ttft_target_s=0.02, priority=-1))
    late = engine.add_request(list(range(300, 320)), SamplingParams(temperature=0, max_tokens=2, ttft_target_s=0.1))
    soon = engine.add_request(list(range(400, 420)), SamplingParams(temperature=0, max_tokens=2, ttft_target_s=0.09))
    finished = []
    while engine.has_unfinished_requests():
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == [first, soon, late]
    stats = engine.stats()
    assert (stats.rejected_slo, stats.rejected_overloaded, stats.rejected_invalid) == (2, 0, 0)
    # soon: first's last 36 (46 ms) and its decode (10), its own 20 (30): 86 ms <= 90. late: 126 > 100.
    assert stats.slo == {"ttft_met": 1, "ttft_missed": 1, "itl_met": 3}

"""The step cost model (runtime/engine/step_cost.py), model-free: synthetic step times from known
coefficients, seeded shapes, no clock."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from runtime.engine.step_cost import (
    DEFAULT_PRIOR,
    OnlineStepCost,
    StepBudget,
    StepCost,
    StepShape,
    full_speed_prefill_s,
)

# A machine unlike the prior's: a faster step overhead, slower attention.
TRUTH = StepCost(base_s=0.004, prefill_token_s=0.0003, decode_seq_s=0.0015, kilo_pair_s=0.002)


def random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    """Engine-like steps: some decodes at various contexts, sometimes a prefill chunk."""
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(n):
        decodes = [(1, int(p)) for p in rng.integers(10, 1500, rng.integers(0, 33))]
        chunk = [(int(rng.integers(2, 513)), int(rng.integers(0, 1024)))] if rng.random() < 0.5 or not decodes else []
        shapes.append(StepShape.of(decodes + chunk))
    return shapes


def relative_errors(model: StepCost, truth: StepCost) -> np.ndarray:
    return np.abs(model.as_array() - truth.as_array()) / truth.as_array()


def test_shape_counts_prefill_decodes_and_attended_pairs():
    shape = StepShape.of([(1, 99), (1, 9), (4, 10)])  # two decodes; a 4-token chunk after 10 cached
    assert shape == StepShape(prefill_tokens=4, decode_seqs=2, attended_pairs=100 + 10 + 4 * 10 + 10)
    assert TRUTH.predict(shape) == pytest.approx(0.004 + 4 * 0.0003 + 2 * 0.0015 + 0.16 * 0.002)


def features(shape: StepShape) -> np.ndarray:
    return np.array([1.0, shape.prefill_tokens, shape.decode_seqs, shape.attended_pairs / 1000.0])


@pytest.mark.parametrize("corrupt", [False, True])
def test_the_fit_folded_at_each_solve_equals_one_update_per_step(corrupt):
    """S and b, folded in at the solve, against the per-step update the class docstring states (float64 here):
    S = gamma S + v z z^T, b = gamma b + v z y. Steps of ~0.1 ms: a solve (and a fold) every ~100 steps.
    `corrupt`: one observation off, which the comparison catches."""
    model = OnlineStepCost()
    gamma, scale = model.forgetting, np.array([1.0, 256.0, 16.0, 32.0])
    S, b = model._S.copy(), model._b.copy()
    level = None
    for i, shape in enumerate(random_shapes(150, seed=3)):
        y = TRUTH.predict(shape) / 100
        model.observe(shape, y * (1.5 if corrupt and i == 7 else 1.0))
        level = y if level is None else gamma * level + (1 - gamma) * y
        v, z = (level / max(y, level / model.max_ratio)) ** 2, features(shape) / scale
        S, b = gamma * S + v * np.outer(z, z), gamma * b + v * z * y
    assert 0 < len(model._pending) < 150, "folded at a solve, some steps since"
    model._fold()
    matches = np.allclose(model._S, S, rtol=1e-9, atol=0) and np.allclose(model._b, b, rtol=1e-9, atol=0)
    assert matches != corrupt


def test_starts_at_the_prior_and_learns_a_synthetic_cost_to_within_half_a_percent():
    model = OnlineStepCost()
    assert model.coefficients == DEFAULT_PRIOR and model.num_observed == 0
    for shape in random_shapes(300):
        model.observe(shape, TRUTH.predict(shape))
    assert relative_errors(model.coefficients, TRUTH).max() < 0.005
    held_out = random_shapes(50, seed=1)
    assert max(abs(model.predict(s) / TRUTH.predict(s) - 1) for s in held_out) < 0.005


def test_noisy_step_times_still_give_predictions_within_a_few_percent():
    rng = np.random.default_rng(2)
    model = OnlineStepCost()
    for shape in random_shapes(400):
        model.observe(shape, TRUTH.predict(shape) * rng.uniform(0.9, 1.1))  # +-10% jitter
    held_out = random_shapes(100, seed=3)
    assert np.mean([abs(model.predict(s) / TRUTH.predict(s) - 1) for s in held_out]) < 0.03


def test_directions_the_steps_never_excite_stay_at_the_prior():
    """Only decode steps of 8 at one context: their time is learned exactly, while the prefill
    cost, which these steps say nothing about, is the prior's."""
    model = OnlineStepCost()
    decode_step = StepShape.of([(1, 500)] * 8)
    for _ in range(500):
        model.observe(decode_step, TRUTH.predict(decode_step))
    assert model.predict(decode_step) == pytest.approx(TRUTH.predict(decode_step), rel=1e-3)
    assert model.coefficients.prefill_token_s == pytest.approx(DEFAULT_PRIOR.prefill_token_s, rel=1e-3)


def test_a_single_stall_is_clipped_and_a_real_slowdown_is_followed():
    model = OnlineStepCost()
    shapes = random_shapes(400)
    for shape in shapes[:200]:
        model.observe(shape, TRUTH.predict(shape))
    probe = StepShape.of([(1, 300)] * 8 + [(128, 0)])
    before = model.predict(probe)
    model.observe(shapes[200], 50 * TRUTH.predict(shapes[200]))  # e.g. the process was descheduled
    assert model.predict(probe) < 1.25 * before  # counted as at most 4x its prediction
    slower = StepCost(*(2 * TRUTH.as_array()))  # the machine got twice as slow (another tenant)
    for shape in shapes[201:400]:
        model.observe(shape, slower.predict(shape))
    assert model.predict(probe) == pytest.approx(slower.predict(probe), rel=0.02)  # within 200 steps


def test_decodes_after_two_prefill_steps_are_learned_not_divided_by_zero():
    """The benchmarks' warm-up (two 500-token prompts): a full 512-token step, then the rest with one
    decode. Fitting four coefficients to two such steps can zero all but the per-token one, so the
    first decode step is predicted at ~0. Clipping it at 4x that prediction, and weighing it by
    (level / y)^2, once made the next solve singular (the engine step raised). Its time counts up to
    the typical step, its weight is bounded, and one step later decodes are predicted right."""
    model = OnlineStepCost()
    model.observe(StepShape(512, 0, 125_328), 0.5435)
    model.observe(StepShape(488, 1, 125_673), 0.5028)
    decodes = [StepShape(0, 2, 2 * (500 + i)) for i in range(30)]
    model.observe(decodes[0], 0.037)
    assert model.predict(decodes[1]) == pytest.approx(0.037, rel=0.01)
    for shape in decodes[1:]:
        model.observe(shape, 0.037)
    assert model.relative_error < 0.02  # the one miss (counted as 100%) fades


def test_coefficients_are_never_negative():
    no_attention = StepCost(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002, kilo_pair_s=0.0)
    model = OnlineStepCost()
    rng = np.random.default_rng(4)
    for shape in random_shapes(300):
        model.observe(shape, no_attention.predict(shape) * rng.uniform(0.8, 1.2))
    assert (model.coefficients.as_array() >= 0).all()


def test_full_speed_prefill_is_chunks_of_the_token_budget():
    cost = StepCost(base_s=10, prefill_token_s=1, decode_seq_s=5, kilo_pair_s=0)
    assert full_speed_prefill_s(cost, 0, 64) == 0.0
    assert full_speed_prefill_s(cost, 64, 64) == 74.0
    assert full_speed_prefill_s(cost, 150, 64) == 74.0 + 74.0 + 32.0


def test_step_budget_fits_chunks_to_the_target_with_a_minimum():
    cost = StepCost(base_s=10, prefill_token_s=1, decode_seq_s=5, kilo_pair_s=0)
    budget = StepBudget(cost, target_s=100, min_prefill_tokens=8)
    for _ in range(4):
        budget.add(1, 50, prefill=False)
    assert budget.fit(500, 0) == 70 and budget.fit(30, 0) == 30  # 100 - 10 - 4 * 5
    budget.add(70, 0, prefill=True)
    assert budget.fit(500, 0) == 0  # the target is reached and the minimum was given
    unlimited = StepBudget(cost, target_s=None, min_prefill_tokens=8)
    assert unlimited.fit(500, 0) == 500
    starved = StepBudget(cost, target_s=100, min_prefill_tokens=8)
    for _ in range(20):  # 10 + 20 * 5 = 110: the decodes alone pass the target
        starved.add(1, 50, prefill=False)
    assert starved.fit(500, 0) == 8 and starved.fit(3, 0) == 3
    starved.add(3, 0, prefill=True)
    assert starved.fit(500, 0) == 5  # what is left of the minimum


def test_relative_error_tracks_the_noise_and_is_capped():
    rng = np.random.default_rng(5)
    exact, noisy = OnlineStepCost(), OnlineStepCost()
    assert exact.relative_error == 0.0
    for shape in random_shapes(300):
        exact.observe(shape, TRUTH.predict(shape))
        noisy.observe(shape, TRUTH.predict(shape) * rng.uniform(0.9, 1.1))  # mean |error| 5%
    assert exact.relative_error < 0.005
    assert 0.03 < noisy.relative_error < 0.07
    wild = OnlineStepCost()
    for shape in random_shapes(50):
        wild.observe(shape, TRUTH.predict(shape) * rng.choice([0.3, 3.0]))
    assert wild.relative_error == 0.25  # budgets never aim lower than 80% of their target


@dataclass(frozen=True)
class Uncertain(StepCost):
    @property
    def relative_error(self) -> float:
        return 0.25


def test_step_budget_aims_below_the_target_by_the_model_error():
    budget = StepBudget(Uncertain(10, 1, 5, 0), target_s=100, min_prefill_tokens=8)
    budget.add(1, 50, prefill=False)
    budget.add(1, 50, prefill=False)
    assert budget.fit(500, 0) == 60  # 100 / 1.25 - 10 - 2 * 5


def test_the_rest_of_a_prompt_may_use_the_headroom_but_never_pass_the_target():
    budget = StepBudget(Uncertain(10, 1, 5, 0), target_s=100, min_prefill_tokens=8)
    budget.add(1, 50, prefill=False)
    budget.add(1, 50, prefill=False)
    assert budget.fit(80, 0) == 60  # a chunk: 100 / 1.25 - 10 - 2 * 5
    assert budget.fit(80, 0, completes=True) == 80  # the prompt's last 80: exactly the target
    assert budget.fit(81, 0, completes=True) == 60  # past the target: cut like any chunk


def test_the_face_search_finds_the_brute_force_minimum():
    """The warm-started search (optimality conditions on the hinted face first) against the minimum over
    every face's feasible stationary point, on random problems with negative unconstrained solutions."""
    import itertools

    from runtime.engine.step_cost import _nonnegative_solve

    def brute(a, c):
        best, best_value = np.zeros(4), 0.0
        for free in itertools.product((False, True), repeat=4):
            mask = np.array(free)
            if not mask.any():
                continue
            w = np.zeros(4)
            w[mask] = np.linalg.solve(a[np.ix_(mask, mask)], c[mask])
            value = float(w @ a @ w - 2 * w @ c)
            if (w >= 0).all() and value < best_value:
                best, best_value = w, value
        return best

    rng = np.random.default_rng(0)
    hint = None
    for _ in range(300):
        m = rng.normal(size=(4, 4))
        a, c = m @ m.T + 0.1 * np.eye(4), rng.normal(size=4)
        w, hint = _nonnegative_solve(a, c, hint)
        assert np.allclose(w, brute(a, c), atol=1e-9), (a, c)
        assert (w[~hint] == 0).all() and (w >= 0).all()

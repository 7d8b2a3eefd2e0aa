"""What an engine step costs, learned as the engine runs, and the prefill a step can afford.

A step's wall time (schedule -> backend -> sample -> detokenize) is modelled as linear in its shape:

    t = base_s + prefill_token_s * P + decode_seq_s * D + kilo_pair_s * A / 1000

P: tokens of chunks longer than one token; D: one-token chunks (decodes); A: (query, key) pairs
attention computes, n * past + n (n + 1) / 2 for a chunk of n tokens after `past` cached ones.

`OnlineStepCost` fits the four coefficients by exponentially weighted least squares,
regularized toward a prior (see there). `StepBudget` fills a step with prefill up to a time
target on top of its decodes (Sarathi-Serve's stall-free batching, with the token budget
derived from the learned costs instead of profiled once).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0  # tokens of chunks longer than one token
    decode_seqs: int = 0  # one-token chunks: decodes (or a prompt's last token)
    attended_pairs: int = 0  # (query, key) pairs attention computes

    def plus_chunk(self, num_tokens: int, past_len: int) -> StepShape:
        pairs = self.attended_pairs + num_tokens * past_len + num_tokens * (num_tokens + 1) // 2
        if num_tokens == 1:
            return StepShape(self.prefill_tokens, self.decode_seqs + 1, pairs)
        return StepShape(self.prefill_tokens + num_tokens, self.decode_seqs, pairs)

    def plus_decodes(self, count: int, total_past: int) -> StepShape:
        """`count` one-token chunks after `total_past` cached tokens in all (a step's decodes at once)."""
        return StepShape(self.prefill_tokens, self.decode_seqs + count, self.attended_pairs + total_past + count)

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> StepShape:
        """The shape of (num_tokens, past_len) chunks."""
        prefill = decodes = pairs = 0
        for num_tokens, past_len in chunks:
            pairs += num_tokens * past_len + num_tokens * (num_tokens + 1) // 2
            if num_tokens == 1:
                decodes += 1
            else:
                prefill += num_tokens
        return cls(prefill, decodes, pairs)


class CostPredictor(Protocol):
    def predict(self, shape: StepShape) -> float:
        """Seconds the step of this shape is expected to take."""
        ...

    @property
    def relative_error(self) -> float:
        """Typical |actual / predicted - 1|: budgets leave this much headroom below a target."""
        ...


@dataclass(frozen=True)
class StepCost:
    """Fixed coefficients (seconds); a CostPredictor of its own (the prior, and tests' fake costs)."""

    base_s: float  # per step: graph launch, sampling setup, Python
    prefill_token_s: float
    decode_seq_s: float
    kilo_pair_s: float  # per 1000 attended (query, key) pairs

    @property
    def relative_error(self) -> float:
        return 0.0  # exact by definition

    def as_array(self) -> np.ndarray:
        return np.array([self.base_s, self.prefill_token_s, self.decode_seq_s, self.kilo_pair_s])

    def predict(self, shape: StepShape) -> float:  # as_array() @ the shape's features, without numpy: many per step
        return (self.base_s + self.prefill_token_s * shape.prefill_tokens + self.decode_seq_s * shape.decode_seqs
                + self.kilo_pair_s * (shape.attended_pairs / 1000.0))  # fmt: skip


# SmolLM2-135M fp32 on the 2-core AVX2 EPYC (cpu backend, uncontended): prefill 64 / 256 / 512
# tokens 75 / 230 / 523 ms; 8 / 32 decodes at context 500: 41 / 84 ms. Other engines start
# from it and correct it within tens of steps.
DEFAULT_PRIOR = StepCost(base_s=0.025, prefill_token_s=0.0008, decode_seq_s=0.002, kilo_pair_s=0.0005)
# The fit is re-solved once the steps observed since the last solve add up to this: a solve (with the fold of
# the steps since) costs ~70 µs of host time, which must stay a small share of the steps it models: every step
# on a CPU (tens of ms), every few on a GPU (2-3 ms a decode step), a few steps' lag against a ~33-step memory.
# Between solves a step's observation is a few float operations and a list append.
SOLVE_EVERY_S = 0.01
# Typical feature magnitudes: the regularizer weighs coefficients by what they contribute.
_SCALE = np.array([1.0, 256.0, 16.0, 32.0])


class OnlineStepCost:
    """Exponentially weighted, relatively weighted ridge regression of step time on StepShape.

    In scaled features z = x / _SCALE (coefficients w = c * _SCALE, seconds each), per step:
        v = (level / y)^2                    relative errors count: a 20 ms decode step as much as a 0.5 s one
        S = gamma S + v z z^T,  b = gamma b + v z y
        w = argmin_{w >= 0}  w^T (S + f I) w - 2 w^T (b + f w0)   (once per SOLVE_EVERY_S of observed steps)
    `level` is an EWMA of observed step times, so the weights do not depend on how fast the
    machine is. S and b start as `prior_weight` pseudo-observations of the prior w0, which fade
    like data; the small constant floor f keeps directions the recent steps do not excite (e.g. no
    prefill for hundreds of steps) at the prior instead of letting them drift (no covariance
    windup). An observation above `max_ratio` times the prediction is clipped there: one stall
    (first run, page faults, another process) must not shrink the budgets for the next hundred
    steps, while a real slowdown still moves the model by up to that factor per step.
    `relative_error` is an EWMA of the one-step-ahead |y / predicted - 1| (clipped y), capped at
    `max_headroom`: step budgets aim that much below their target, so noise does not put every
    other step over it, and a bad start (the prior) cannot shrink them by more than the cap.
    """

    def __init__(
        self,
        prior: StepCost = DEFAULT_PRIOR,
        forgetting: float = 0.97,  # ~33-step memory: follows a 2x slowdown to within 5% in ~125 steps
        prior_weight: float = 1e-3,  # the first step outweighs it: the prior only fills in what no step showed
        floor_weight: float = 1e-6,
        max_ratio: float = 4.0,
        max_headroom: float = 0.25,
    ) -> None:
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1] (got {forgetting})")
        self.prior = prior
        self.forgetting = forgetting
        self.floor_weight = floor_weight
        self.max_ratio = max_ratio
        self.max_headroom = max_headroom
        self._error = 0.0
        self._w0 = prior.as_array() * _SCALE
        self._S = prior_weight * np.eye(4)
        self._b = prior_weight * self._w0
        self._level: float | None = None  # EWMA of step times: the unit relative errors are weighed in
        self._coefficients = prior
        self._active: np.ndarray | None = None  # the last solve's free coefficients, tried first next time
        self._unsolved_s = 0.0  # step time observed since the last solve
        # (v, y, prefill tokens, decodes, kilo pairs) of each step since the last solve, folded into S and b then
        self._pending: list[tuple[float, float, int, int, float]] = []
        self.num_observed = 0

    @property
    def coefficients(self) -> StepCost:
        return self._coefficients

    def predict(self, shape: StepShape) -> float:
        return self._coefficients.predict(shape)

    @property
    def relative_error(self) -> float:
        return min(self._error, self.max_headroom)

    def observe(self, shape: StepShape, seconds: float) -> None:
        predicted = max(self.predict(shape), 1e-9)
        # A stall is clipped at max_ratio x the prediction, but never below the typical step: a model
        # that has not seen this kind of step yet (decodes after two prefill steps) may predict ~0.
        ceiling = max(self.max_ratio * predicted, self._level or seconds)
        y = max(min(seconds, ceiling), 1e-9)
        level = y if self._level is None else self.forgetting * self._level + (1 - self.forgetting) * y
        self._level = level
        if self.num_observed:  # the first step only tells how wrong the prior was
            miss = min(abs(y / predicted - 1), 1.0)  # one wild miss must not hold the headroom for long
            self._error = self.forgetting * self._error + (1 - self.forgetting) * miss
        v = (level / max(y, level / self.max_ratio)) ** 2  # bounded: a tiny step cannot swamp the fit
        self._pending.append((v, y, shape.prefill_tokens, shape.decode_seqs, shape.attended_pairs / 1000.0))
        self.num_observed += 1
        self._unsolved_s += y
        if self._unsolved_s >= SOLVE_EVERY_S:
            self._unsolved_s = 0.0
            self._fold()
            a, c = self._S + self.floor_weight * _FLOOR, self._b + self.floor_weight * self._w0
            w, self._active = _nonnegative_solve(a, c, self._active)
            self._coefficients = StepCost(*(float(c) for c in w / _SCALE))

    def _fold(self) -> None:
        """S and b updated by the observations since the last solve, at once: the same sums as one update per
        step (the i-th of n has faded by gamma^(n-1-i)), in a few numpy calls instead of a few per step."""
        if not self._pending:
            return
        pending = np.array(self._pending)
        self._pending.clear()
        n = len(pending)
        weights = self.forgetting ** np.arange(n - 1, -1, -1.0) * pending[:, 0]
        z = np.column_stack([np.ones(n), pending[:, 2:]]) / _SCALE
        faded = self.forgetting**n
        self._S = faded * self._S + (z * weights[:, None]).T @ z
        self._b = faded * self._b + z.T @ (weights * pending[:, 1])


_FLOOR = np.eye(4)
_FACES = [np.array(free) for free in itertools.product((False, True), repeat=4)]  # which coefficients are free


def _nonnegative_solve(a: np.ndarray, c: np.ndarray, hint: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """argmin_{w >= 0} w^T a w - 2 w^T c for positive definite `a` (a cost is never negative), and the face it
    lies on (its free coefficients). The problem is strictly convex, so a face whose stationary point is
    feasible and satisfies the optimality conditions (no fixed coefficient's gradient pulls it below 0) is
    the minimum: `hint`, the last step's face, is checked first (steps rarely change it), then the
    unconstrained one, then every face. Exact, and one 4x4 solve per step in the common case."""
    order = [f for f in (hint, _FACES[-1]) if f is not None] + _FACES
    for free in order:
        w = np.zeros(len(c))
        if free.any():
            w[free] = np.linalg.solve(a[np.ix_(free, free)], c[free]) if not free.all() else np.linalg.solve(a, c)
        gradient = a @ w - c
        if (w >= 0).all() and (gradient[~free] >= -1e-12 * (1 + abs(c[~free]))).all():
            return w, free
    raise AssertionError("a strictly convex problem has a face satisfying its optimality conditions")


def full_speed_prefill_s(cost: CostPredictor, num_tokens: int, max_batched_tokens: int) -> float:
    """A lower bound on prefilling `num_tokens` with nothing else running: chunks of the full
    token budget, each attending only to itself."""
    full, rest = divmod(num_tokens, max_batched_tokens)
    seconds = full * cost.predict(StepShape().plus_chunk(max_batched_tokens, 0)) if full else 0.0
    return seconds + (cost.predict(StepShape().plus_chunk(rest, 0)) if rest else 0.0)


@dataclass
class StepBudget:
    """The prefill one step may carry: chunks fit while the predicted step stays within `target_s`
    (None: no time limit) less the cost model's typical error, but at least `min_prefill_tokens` in
    all, so waiting prompts progress even when decodes fill the target."""

    cost: CostPredictor
    target_s: float | None
    min_prefill_tokens: int
    shape: StepShape = field(default_factory=StepShape)
    prefill_tokens: int = 0  # scheduled in the prefill phase

    def add_decodes(self, count: int, total_past: int) -> None:
        """`count` one-token decodes after `total_past` cached tokens in all, at once."""
        self.shape = self.shape.plus_decodes(count, total_past)

    def add(self, num_tokens: int, past_len: int, prefill: bool) -> None:
        self.shape = self.shape.plus_chunk(num_tokens, past_len)
        self.prefill_tokens += num_tokens if prefill else 0

    def fit(self, want: int, past_len: int, completes: bool = False) -> int:
        """How many of `want` prefill tokens, after `past_len` cached ones, this step takes.
        `completes`: `want` is the rest of a prompt. Taken whole, its user gets the first token a
        step sooner, so it may use the headroom kept for the model's error (never the target itself)."""
        if self.target_s is None or want <= 0:
            return max(want, 0)
        aim = self.target_s / (1 + self.cost.relative_error)

        def fits(n: int, seconds: float = aim) -> bool:
            return self.cost.predict(self.shape.plus_chunk(n, past_len)) <= seconds

        if fits(want) or (completes and fits(want, self.target_s)):
            return want
        lo, hi = 0, want  # cost grows with n: bisect for the largest n that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return max(lo, min(want, self.min_prefill_tokens - self.prefill_tokens))

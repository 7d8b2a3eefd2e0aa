"""Sampler vs an independent per-row reference (plain loops, float64), on random logits."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from executors.sampling import Sampler, SamplingParams, SamplingState, numpy_sampler
from executors.sampling.numpy_sampler import apply_penalties

V = 64


def state(prompt: Sequence[int] = (), vocab: int = V, **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), list(prompt), vocab)


# ---- reference: one row at a time, loops and np.sort, float64 ----


def ref_penalize(logits: np.ndarray, prompt: Sequence[int], output: Sequence[int], p: SamplingParams):
    x = [float(v) for v in logits]
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = output.count(t)
        x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return np.array(x)


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(sum(math.exp(v - m) for v in x))


def ref_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """vLLM order: temperature, min-p, top-k, then top-p over the renormalized survivors."""
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    kept = [t for t in range(len(x)) if probs[t] >= p.min_p * probs.max()]
    if p.top_k:
        kth = np.sort(x)[::-1][min(p.top_k, len(x)) - 1]
        kept = [t for t in kept if x[t] >= kth]
    mass = sum(probs[t] for t in kept)
    final, acc = [], 0.0
    for t in sorted(kept, key=lambda t: -x[t]):
        final.append(t)
        acc += probs[t] / mass
        if acc >= p.top_p:
            break
    out = np.zeros(len(x))
    out[final] = probs[final]
    return out / out.sum()


def random_params(rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5])),
        top_k=int(rng.choice([0, 1, 5, 20])),
        top_p=float(rng.choice([1.0, 0.9, 0.5, 0.2])),
        min_p=float(rng.choice([0.0, 0.05, 0.2])),
    )


# ---- greedy and penalties ----


def test_greedy_equals_argmax_and_draws_nothing() -> None:
    logits = np.random.default_rng(0).normal(size=(6, V)).astype(np.float32)
    for lp in (None, 3):  # fast path, and the full path (logprobs requested)
        states = [state(temperature=0.0, seed=i, logprobs=lp) for i in range(6)]
        res = Sampler().sample(logits, states)
        np.testing.assert_array_equal(res.token_ids, np.argmax(logits, axis=1))
        assert res.token_ids.dtype == np.int64
        for i, s in enumerate(states):
            assert s.rng.random() == np.random.default_rng(i).random()  # stream not advanced


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = np.array([[0.0, 3.0, 1.0, 3.0]], dtype=np.float32)
    assert Sampler().sample(logits, [state(vocab=4, temperature=0.0)]).token_ids[0] == 1


LOGITS4 = np.array([[2.0, -1.0, 0.5, 1.0]], dtype=np.float32)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        # seen = prompt {0} ∪ output {1, 3}: positives divided by 2, negatives multiplied.
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.5, 0.5]),
        # presence: 0.5 once for tokens 1 and 3.
        ({"presence_penalty": 0.5}, [2.0, -1.5, 0.5, 0.5]),
        # frequency: 0.5 per occurrence; token 3 appeared twice.
        ({"frequency_penalty": 0.5}, [2.0, -1.5, 0.5, 0.0]),
        # repetition first, then frequency and presence.
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
            [1.0, -2.75, 0.5, -0.75],
        ),
    ],
)
def test_penalties_hand_computed(kw: dict, expected: list[float]) -> None:
    s = state(prompt=[0], vocab=4, **kw)
    for t in (1, 3, 3):
        s.append(t)
    before = LOGITS4.copy()
    np.testing.assert_allclose(apply_penalties(LOGITS4, [s])[0], expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(LOGITS4, before)  # caller's logits untouched


def test_penalty_changes_greedy_choice() -> None:
    s = state(prompt=[0], vocab=4, temperature=0.0, repetition_penalty=4.0)
    assert Sampler().sample(LOGITS4, [s]).token_ids[0] == 3  # 2/4 = 0.5 < 1.0


def test_penalties_match_reference_on_random_batch() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=3, size=(8, V)).astype(np.float32)
    states, outputs = [], []
    for i in range(8):
        kw = {
            "repetition_penalty": float(rng.choice([1.0, 0.8, 1.3])),
            "presence_penalty": float(rng.choice([0.0, -0.5, 1.0])),
            "frequency_penalty": float(rng.choice([0.0, 0.3, -1.0])),
        }
        s = state(prompt=rng.integers(0, V, 10).tolist(), **kw)
        out = rng.integers(0, V, 15).tolist() if i % 3 else []
        for t in out:
            s.append(t)
        states.append(s)
        outputs.append(out)
    got = apply_penalties(logits, states)
    assert got.dtype == np.float32
    for i, s in enumerate(states):
        ref = ref_penalize(logits[i], s.prompt_token_ids, outputs[i], s.params)
        np.testing.assert_allclose(got[i], ref, rtol=1e-6, atol=1e-5)


# ---- filters ----

FILTER_CASES = [
    {"top_k": 5},
    {"top_p": 0.5},
    {"top_p": 0.9, "temperature": 0.5},
    {"min_p": 0.1},
    {"top_k": 10, "top_p": 0.7, "min_p": 0.02, "temperature": 1.3},
    {"top_k": 1},
    {"top_p": 1e-6},
    {"min_p": 1.0},
]


def check_distribution(dist_fn: Callable, seed: int) -> None:
    """Each case, on random logits: dist_fn's distribution equals the reference to 1e-6."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2, size=(len(FILTER_CASES), V)).astype(np.float32)
    states = [state(**kw) for kw in FILTER_CASES]
    got = dist_fn(logits, states)
    for i, s in enumerate(states):
        np.testing.assert_allclose(got[i], ref_distribution(logits[i], s.params), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_distribution_matches_reference(seed: int) -> None:
    check_distribution(Sampler().distribution, seed)


def test_distribution_matches_reference_mixed_random_params() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(scale=2, size=(64, V)).astype(np.float32)
    params = [random_params(rng) for _ in range(64)]
    got = Sampler().distribution(logits, [SamplingState(p, [], V) for p in params])
    for i, p in enumerate(params):
        np.testing.assert_allclose(got[i], ref_distribution(logits[i], p), rtol=0, atol=1e-6)


def test_broken_top_p_is_detected() -> None:
    """The reference comparison can fail: top-p (and the other filters) really change the distribution,
    and a sampler that ignores top_p is caught."""
    logits = np.random.default_rng(0).normal(scale=2, size=V).astype(np.float32)
    p = SamplingParams(top_p=0.5)
    unfiltered = ref_distribution(logits, SamplingParams())
    assert np.abs(ref_distribution(logits, p) - unfiltered).max() > 0.05

    def ignores_top_p(logits: np.ndarray, states: list[SamplingState]) -> np.ndarray:
        unfiltered = [SamplingState(SamplingParams(**{**vars(s.params), "top_p": 1.0}), [], V) for s in states]
        return Sampler().distribution(logits, unfiltered)

    with pytest.raises(AssertionError):
        check_distribution(ignores_top_p, seed=0)


def test_sampled_tokens_stay_in_kept_set() -> None:
    rng = np.random.default_rng(3)
    logits = np.repeat(rng.normal(scale=2, size=(1, V)).astype(np.float32), 400, axis=0)
    for kw in FILTER_CASES:
        kept = set(np.flatnonzero(ref_distribution(logits[0], SamplingParams(**kw))))
        res = Sampler().sample(logits, [state(seed=i, **kw) for i in range(400)])
        seen = set(res.token_ids.tolist())
        assert seen <= kept, kw
        if len(kept) <= 5:
            assert seen == kept, kw  # 400 draws reach every kept token of a small set


def test_only_one_token_survives_no_nan() -> None:
    logits = np.full((3, V), -np.inf, dtype=np.float32)
    logits[:, 7] = 1e30  # one huge logit, everything else banned
    logits[1, 9] = 1e30 - 1e24  # a near-tie that min_p=1 and a tiny temperature still separate
    states = [state(seed=0), state(seed=1, min_p=1.0, temperature=1e-30), state(seed=2, top_p=1e-9)]
    dist = Sampler().distribution(logits, states)
    assert not np.isnan(dist).any()
    np.testing.assert_array_equal(Sampler().sample(logits, states).token_ids, [7, 7, 7])


def test_ties_at_a_cutoff_stay_whole() -> None:
    """Every filter keeps whole groups of equal logits: the kept set never depends on how ties are ordered."""
    logits = np.array([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]], dtype=np.float32)
    top_k = Sampler().distribution(logits, [state(vocab=6, top_k=2)])[0]
    np.testing.assert_array_equal(top_k > 0, [True, False, True, True, True, False])  # the 2nd largest is a tie of 3
    top_p = Sampler().distribution(logits, [state(vocab=6, top_p=0.6)])[0]  # 3.0 alone is ~0.46 of the mass
    np.testing.assert_array_equal(top_p > 0, [True, False, True, True, True, False])


LARGE_V = 49_152  # SmolLM2's vocabulary: rows where the candidates are a small part of the row


@pytest.mark.parametrize("temperature", [0.7, 1.5, 2.0])
def test_candidate_cutoffs_equal_whole_row_cutoffs(monkeypatch, temperature: float) -> None:
    """The cutoffs found among a row's candidates (each floor in turn) are the ones a sort of the whole row
    gives, on LM-like rows (a few strong tokens over a long tail), including rows where a floor is too high."""
    rng = np.random.default_rng(int(temperature * 10))
    logits = rng.normal(scale=2.0, size=(12, LARGE_V)).astype(np.float32)
    logits[:, :30] += rng.uniform(4, 14, size=(12, 30)).astype(np.float32)
    params = [
        SamplingParams(temperature=temperature, **kw)
        for kw in ({"top_p": 0.9}, {"top_p": 0.99}, {"top_p": 0.5, "min_p": 0.01}, {"top_k": 40}, {"top_k": 5000},
                   {"top_k": 100, "top_p": 0.95}, {"top_k": 3, "top_p": 0.1}, {"min_p": 0.2}, {"top_p": 0.999},
                   {"top_k": 1}, {"top_p": 1e-9}, {})
    ]  # fmt: skip
    got, first_floor = numpy_sampler.filtered_probs(logits, params), numpy_sampler.CANDIDATE_FLOORS[0]
    monkeypatch.setattr(numpy_sampler, "CANDIDATE_FLOORS", (0.0,))  # every row sorted whole
    want = numpy_sampler.filtered_probs(logits, params)
    np.testing.assert_array_equal(got, want)
    if temperature >= 1.5:  # some row keeps tokens below the first floor: the fallback ran and agreed
        assert (np.where(want[:-1] > 0, want[:-1], 1.0).min(axis=1) < first_floor).any()  # [-1]: no filter


def test_a_floor_that_misses_the_nucleus_is_caught(monkeypatch) -> None:
    """The fallback is what makes the candidates exact: a single high floor with no fallback keeps too few."""
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=1.0, size=(1, LARGE_V)).astype(np.float32)  # flat: the nucleus is huge
    params = [SamplingParams(temperature=1.0, top_p=0.9)]
    want = numpy_sampler.filtered_probs(logits, params)
    monkeypatch.setattr(numpy_sampler, "CANDIDATE_FLOORS", (0.5, 0.0))
    np.testing.assert_array_equal(numpy_sampler.filtered_probs(logits, params), want)
    monkeypatch.setattr(numpy_sampler, "CANDIDATE_FLOORS", (0.5,))
    with pytest.raises(AssertionError, match="unreachable"):
        numpy_sampler.filtered_probs(logits, params)


@pytest.mark.parametrize("vocab", [V, 1000, LARGE_V])
def test_inverse_cdf_is_a_float64_search_in_id_order(vocab: int) -> None:
    """Two levels of blocks give the token a full float64 running sum gives, and never a dropped (0) token."""
    rng = np.random.default_rng(vocab)
    probs = rng.random((64, vocab)).astype(np.float32) ** 8  # uneven mass
    probs[rng.random(probs.shape) < 0.5] = 0.0  # dropped tokens between kept ones
    probs[np.arange(64), rng.integers(0, vocab, 64)] = 1.0
    u = rng.random(64)
    u[:3] = [0.0, 1.0 - 1e-16, 0.5]
    got = numpy_sampler.inverse_cdf(probs, u)
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    want = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, u * cdf[:, -1], strict=True)])
    want = np.minimum(want, vocab - 1 - np.argmax(probs[:, ::-1] > 0, axis=1))
    assert (got == want).mean() > 0.98  # they may part only where the uniform lands on a rounding boundary
    assert (probs[np.arange(64), got] > 0).all()


# ---- temperature, determinism, logprobs ----


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_empirical_distribution(temperature: float) -> None:
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0], dtype=np.float32)
    batch = np.repeat(logits[None], 1000, axis=0)
    states = [state(vocab=5, temperature=temperature, seed=1000 + i) for i in range(1000)]
    sampler = Sampler()
    draws = np.concatenate([sampler.sample(batch, states).token_ids for _ in range(20)])
    freq = np.bincount(draws, minlength=5) / draws.size
    expected = np.exp(ref_log_softmax(logits / temperature))
    assert np.abs(freq - expected).max() < 0.02, (freq, expected)


@pytest.mark.parametrize("kw", [{"top_p": 0.7}, {"top_k": 3, "temperature": 1.5}, {"min_p": 0.2, "top_p": 0.9}])
def test_filtered_sampling_empirical_distribution(kw: dict) -> None:
    """sample() itself (not just distribution()) draws from the renormalized kept set."""
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7], dtype=np.float32)
    states = [state(vocab=8, seed=i, **kw) for i in range(1000)]
    batch, sampler = np.repeat(logits[None], 1000, axis=0), Sampler()
    draws = np.concatenate([sampler.sample(batch, states).token_ids for _ in range(20)])
    freq = np.bincount(draws, minlength=8) / draws.size
    expected = ref_distribution(logits, SamplingParams(**kw))
    assert np.abs(freq - expected).max() < 0.02, (freq, expected)


def run(states: list[SamplingState], rows: np.ndarray, steps: int) -> list[list[int]]:
    sampler, out = Sampler(), [[] for _ in states]
    for _ in range(steps):
        tokens = sampler.sample(rows, states).token_ids.tolist()
        for s, o, t in zip(states, out, tokens, strict=True):
            s.append(t)
            o.append(t)
    return out


def test_seed_determinism_independent_of_batch() -> None:
    rng = np.random.default_rng(11)
    rows = rng.normal(scale=1.5, size=(8, V)).astype(np.float32)
    target = {"seed": 1234, "top_p": 0.95, "top_k": 40, "presence_penalty": 0.3, "logprobs": 2}

    def make_target() -> SamplingState:
        return state(prompt=[1, 2, 3], **target)

    others = [
        state(temperature=0.0),
        state(seed=5, temperature=0.4),
        state(),  # unseeded
        state(seed=9, min_p=0.1, frequency_penalty=1.0, logprobs=5),
        state(seed=2, top_k=3),
        state(temperature=0.0, repetition_penalty=1.5),
        state(seed=7, top_p=0.3, temperature=2.0),
    ]
    alone = run([make_target()], rows[3:4], 30)[0]
    batched = run([*others[:3], make_target(), *others[3:]], rows, 30)[3]
    assert alone == batched
    assert len(set(alone)) > 3  # a real random sequence, not a constant
    other_seed = run([state(prompt=[1, 2, 3], **{**target, "seed": 4321})], rows[3:4], 30)[0]
    assert other_seed != alone


def test_logprobs() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(scale=2, size=(4, V)).astype(np.float32)
    states = [
        state(seed=0, logprobs=5, temperature=0.7, top_k=3),
        state(logprobs=None),
        state(temperature=0.0, logprobs=0),
        state(prompt=[4, 5], seed=1, logprobs=20, repetition_penalty=1.7, frequency_penalty=0.4),
    ]
    states[3].append(int(np.argmax(logits[3])))
    res = Sampler().sample(logits, states)
    assert res.logprobs[1] is None
    for i in (0, 2, 3):
        tl = res.logprobs[i]
        assert tl is not None and tl.token_id == res.token_ids[i]
        s = states[i]
        out = [int(np.argmax(logits[3]))] if i == 3 else []
        ref = ref_log_softmax(ref_penalize(logits[i], s.prompt_token_ids, out, s.params))
        assert tl.logprob == pytest.approx(ref[tl.token_id], abs=1e-5)  # before temperature / top-k
        n = s.params.logprobs
        assert len(tl.top) == n
        assert [t for t, _ in tl.top] == np.argsort(-ref, kind="stable")[:n].tolist()
        np.testing.assert_allclose([v for _, v in tl.top], np.sort(ref)[::-1][:n], atol=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(tl.top, tl.top[1:], strict=False))


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="batch"):
        Sampler().sample(np.zeros((2, V), np.float32), [state()])
    with pytest.raises(ValueError, match="vocab"):
        Sampler().sample(np.zeros((1, V + 1), np.float32), [state()])

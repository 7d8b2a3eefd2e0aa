"""The rejection sampler: greedy against sequential sampling, random against the target
distribution (chi-square over seeded draws, which fails when the residual step is skipped)."""

from __future__ import annotations

import numpy as np
import pytest

from executors.sampling import Sampler, SamplingParams, SamplingState
from runtime.engine.spec import RejectionSampler
from runtime.engine.spec import rejection_sampler as rejection_module

V = 6
# Chi-square critical values at alpha = 1e-3, by degrees of freedom.
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
TARGET = np.log(np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]))
POOR_Q = np.array([0.02, 0.03, 0.05, 0.10, 0.30, 0.50])  # puts its mass where p has little


def state(params: SamplingParams, prompt=(0,), vocab: int = V) -> SamplingState:
    return SamplingState(params, list(prompt), vocab)


def sequential(logits: np.ndarray, drafts: list[int], s: SamplingState) -> list[int]:
    """Sampling without speculation: sample row j after appending the tokens emitted so far; stop at
    the first token that differs from the draft (the rows past it were computed for nothing)."""
    out = []
    for j in range(len(drafts) + 1):
        token = int(Sampler().sample(logits[j : j + 1], [s]).token_ids[0])
        out.append(token)
        s.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return out


def test_greedy_accepts_the_argmax_prefix_then_emits_the_argmax():
    rows_a = np.eye(8)[[3, 5, 1, 6]] * 4.0  # argmax per row: 3, 5, 1, 6
    rows_b = np.eye(8)[[3, 4]] * 4.0
    rows_c = np.eye(8)[[7]] * 4.0
    logits = np.concatenate([rows_a, rows_b, rows_c]).astype(np.float32)
    greedy = SamplingParams(temperature=0)
    result = RejectionSampler().verify(logits, [[3, 5, 2], [3], []], [state(greedy, vocab=8) for _ in range(3)])
    assert result.token_ids == [[3, 5, 1], [3, 4], [7]]  # rejected at d3; all accepted + bonus; no drafts
    assert result.num_accepted.tolist() == [2, 1, 0]
    assert result.logprobs == [None, None, None]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2)])
def test_rows_pick_the_verify_rows_out_of_the_step(params):
    """A step's logits hold other requests' rows between the verify rows: `rows` picks them, the greedy
    path (argmax over the step, no gather) and the general one alike. Rows that are not picked have
    other argmaxes, so picking a wrong one changes the result."""
    packed = (np.eye(8)[[3, 5, 1, 6, 3, 4, 7]] * 4.0).astype(np.float32)
    drafts = [[3, 5, 2], [3], []]
    rows = np.array([1, 2, 4, 5, 7, 8, 10])
    step = np.tile(np.eye(8, dtype=np.float32)[0] * 9.0, (11, 1))  # argmax 0 where no verify row lies
    step[rows] = packed
    expected = RejectionSampler().verify(packed, drafts, [state(params, vocab=8) for _ in range(3)])
    got = RejectionSampler().verify(step, drafts, [state(params, vocab=8) for _ in range(3)], rows=rows)
    assert got.token_ids == expected.token_ids == [[3, 5, 1], [3, 4], [7]]
    assert got.num_accepted.tolist() == expected.num_accepted.tolist()
    shifted = RejectionSampler().verify(step, drafts, [state(params, vocab=8) for _ in range(3)], rows=rows - 1)
    assert shifted.token_ids != expected.token_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2),
        SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.9, seed=7, logprobs=1),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.5, seed=8),
    ],
)
def test_one_hot_drafts_emit_exactly_what_sequential_sampling_emits(params):
    """Row j sees d_1..d_j as generated (a penalty can turn an accepted draft's repeat into a
    rejection), and a seeded request's generator is used as without speculation: the same tokens,
    the same stream position afterwards."""
    rng = np.random.default_rng(4)
    for trial in range(40):
        k = int(rng.integers(0, 5))
        logits = rng.normal(size=(k + 1, V)).astype(np.float32)
        logits[:, 2] += 1.5  # token 2 tends to win, so drafts of 2 are often accepted, then penalized
        drafts = [2 if rng.random() < 0.7 else int(rng.integers(0, V)) for _ in range(k)]
        got_state = state(params, prompt=[1, 2])
        result = RejectionSampler().verify(logits, [drafts], [got_state])
        want_state = state(params, prompt=[1, 2])
        want = sequential(logits, drafts, want_state)
        assert result.token_ids == [want], trial
        if params.seed is not None:
            assert got_state.rng.random() == want_state.rng.random()
        if params.logprobs is not None:
            ref_state = state(params, prompt=[1, 2])
            for j, token in enumerate(want):
                lp = Sampler().sample(logits[j : j + 1], [ref_state]).logprobs[0]
                got = result.logprobs[0][j]
                assert got.token_id == token and got.logprob == pytest.approx(
                    lp.logprob if lp.token_id == token else None, abs=1e-6
                )
                assert got.top == lp.top
                ref_state.append(token)


def chi_square(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the tokens p gives mass; tokens without mass must not occur."""
    assert counts[p == 0].sum() == 0, "a token the target excludes was emitted"
    expected = p[p > 0] * counts.sum()
    return float(((counts[p > 0] - expected) ** 2 / expected).sum()), int((p > 0).sum()) - 1


def sample_emitted(params: SamplingParams, q: np.ndarray | None, n: int = 20000, k: int = 2):
    """n seeded requests verify k drafts each against a context-free target (every row TARGET);
    drafts come from q (None: the n-gram case, fixed drafts [3, 0] with one-hot q)."""
    rng = np.random.default_rng(1)
    logits = np.tile(TARGET.astype(np.float32), (n * (k + 1), 1))
    if q is None:
        drafts = [[3, 0][:k] for _ in range(n)]
        probs = None
    else:
        drafts = np.minimum(np.searchsorted(np.cumsum(q), rng.random((n, k)), side="right"), V - 1).tolist()
        probs = [np.tile(q, (k, 1)) for _ in range(n)]
    states = [state(SamplingParams(**{**params.__dict__, "seed": i})) for i in range(n)]
    return RejectionSampler().verify(logits, drafts, states, probs).token_ids


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.8, min_p=0.2)],
)
@pytest.mark.parametrize("q", [POOR_Q, None], ids=["poor-draft", "ngram-one-hot"])
def test_emitted_tokens_follow_the_target_distribution(params, q):
    p = Sampler().distribution(TARGET[None].astype(np.float32), [state(params)])[0]
    emitted = sample_emitted(params, q)
    for position in (0, 1):  # every emitted position follows p (the target is context-free)
        tokens = np.array([t[position] for t in emitted if len(t) > position])
        assert tokens.size > 1000
        stat, df = chi_square(np.bincount(tokens, minlength=V), p)
        assert stat < CHI2_CRITICAL[df], (position, stat, np.bincount(tokens, minlength=V) / tokens.size, p)
    if q is not None:
        assert any(len(t) == 1 for t in emitted) and any(len(t) == 3 for t in emitted)  # rejections and bonuses


def test_skipping_the_residual_step_is_caught(monkeypatch):
    """Drawing from p instead of max(0, p - q) after a rejection over-weights what q favours."""
    params = SamplingParams(temperature=1.0)
    p = Sampler().distribution(TARGET[None].astype(np.float32), [state(params)])[0]
    monkeypatch.setattr(rejection_module, "residual", lambda p_row, q_row: p_row)
    emitted = sample_emitted(params, POOR_Q)
    stat, df = chi_square(np.bincount([t[0] for t in emitted], minlength=V), p)
    assert stat > 10 * CHI2_CRITICAL[df]


def test_a_seeded_request_does_not_depend_on_its_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=11)
    alone = RejectionSampler().verify(logits, [[1, 2]], [state(params)]).token_ids[0]
    others = rng.normal(size=(4, V)).astype(np.float32)
    batch = RejectionSampler().verify(
        np.concatenate([others[:2], logits, others[2:]]), [[0], [1, 2], [3]],
        [state(SamplingParams(temperature=1.0)), state(params), state(SamplingParams(temperature=1.0))],
    )  # fmt: skip
    assert batch.token_ids[1] == alone


def test_logits_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"\[4, vocab\]"):
        RejectionSampler().verify(np.zeros((3, V), np.float32), [[1, 2, 3]], [state(SamplingParams())])

"""Batched token sampling on the host: logit biases, penalties, temperature, min-p / top-k / top-p, seeded draws,
logprobs (the semantics executors/sampling/torch_sampler.py repeats on a device).

numpy only. Everything that touches the vocabulary is a [B, V] array op; the only per-row Python
work is drawing one uniform from each row's own Generator, so a seeded request's output depends
only on its seed and its logits, never on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine_format import ceil_div
from executors.sampling.grammar import mask_logits
from executors.sampling.params import SamplingParams
from executors.sampling.state import FLOAT32_TINY, SampleResult, SamplingState, TokenLogprobs, check_batch


class Sampler:
    """One token per row. Greedy rows (temperature 0) take the argmax and draw nothing random.

    Random rows follow vLLM's order: temperature, min-p, top-k, then top-p over the renormalized
    survivors; each draws exactly one uniform per step and samples by inverse CDF over the kept
    tokens in id order (inverse_cdf), so no row is sorted to draw from it.

    Logprobs are the log-softmax of the *penalized* (and biased) logits, before temperature and filtering
    (vLLM's "raw_logprobs" is taken before both, so the two differ only when a penalty or bias is active).
    A request with a grammar samples from its masked logits (grammar.py), logprobs too.
    """

    def sample(self, logits: np.ndarray, states: Sequence[SamplingState]) -> SampleResult:
        logits = mask_logits(_check(logits, states), states)  # structured output: -inf where a grammar refuses
        if all(s.argmax_only for s in states):
            return SampleResult(np.argmax(logits, axis=1).astype(np.int64), [None] * len(states))
        greedy = np.array([s.params.greedy for s in states], dtype=bool)
        x = apply_penalties(logits, states)
        token_ids = np.argmax(x, axis=1).astype(np.int64)  # random rows are overwritten below
        rand = np.flatnonzero(~greedy)
        if rand.size:
            u = np.array([states[i].rng.random() for i in rand])  # one draw per row from its own stream
            rows = x if rand.size == len(states) else x[rand]  # a [B, V] copy only when some rows are greedy
            token_ids[rand] = draw(rows, [states[i].params for i in rand], u)
        return SampleResult(token_ids, token_logprobs(x, token_ids, states))

    def distribution(self, logits: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
        """[B, V] float64: the distribution each row draws from (greedy rows: one-hot argmax)."""
        logits = mask_logits(_check(logits, states), states)  # structured output: -inf where a grammar refuses
        x = apply_penalties(logits, states)
        out = np.zeros(x.shape, dtype=np.float64)
        out[np.arange(len(states)), np.argmax(x, axis=1)] = 1.0
        rand = np.flatnonzero([not s.params.greedy for s in states])
        if rand.size:
            probs = filtered_probs(x[rand], [states[i].params for i in rand]).astype(np.float64)
            out[rand] = probs / probs.sum(axis=1, keepdims=True)
        return out


def draw(x: np.ndarray, params: Sequence[SamplingParams], u: np.ndarray) -> np.ndarray:
    """The token each row of penalized logits `x` draws with its uniform u: inverse CDF over the
    filtered distribution (also the speculative verifier's draw, so a seeded request samples the same
    tokens with speculation on or off)."""
    return inverse_cdf(filtered_probs(x, params), u)


def filtered_probs(x: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """[R, V] float32: each row's probabilities relative to its top token (which gets exactly 1) after
    temperature, min-p, top-k and top-p; 0 where a filter drops the token.

    Each filter keeps the tokens whose logit reaches a cutoff, ties at it included: min-p keeps
    prob >= min_p * max_prob; top-k keeps logits >= the k-th largest; top-p keeps the fewest top logits
    whose mass reaches top_p of what min-p and top-k left. So the kept set never depends on how equal
    logits are ordered, and no row is sorted whole: top-k and top-p rows sort only their candidates
    (see _cutoff); rows with neither filter sort nothing.
    """
    temp = np.array([max(p.temperature, FLOAT32_TINY) for p in params], dtype=np.float32)[:, None]
    # Shift by the row max before dividing: the top token lands on exactly 0, so a tiny temperature
    # sends the rest to -inf (an expected overflow) and never makes inf - inf = NaN.
    scaled = x - x.max(axis=1, keepdims=True)
    with np.errstate(over="ignore"):
        scaled /= temp
    probs = np.exp(scaled)  # prob / max_prob; the top entry is exactly 1
    min_p = np.array([p.min_p for p in params], dtype=np.float64)[:, None]  # compared in float64
    v = x.shape[1]
    rows = [i for i, p in enumerate(params) if 0 < p.top_k < v or p.top_p < 1.0]
    keep = probs >= min_p if min_p.any() else None
    if rows:
        cuts = np.full((len(params), 1), -np.inf, np.float32)
        for i in rows:
            p = params[i]
            cuts[i] = _cutoff(scaled[i], probs[i], float(min_p[i, 0]), p.top_k if p.top_k < v else 0, p.top_p)
        keep = scaled >= cuts if keep is None else keep & (scaled >= cuts)
    if keep is not None:
        probs *= keep  # in place: one pass, no new [R, V] array (their page faults cost as much as the math)
    return probs


# Relative probabilities (prob / max prob) tried in turn as the floor of a top-k / top-p row's candidates.
# A floor that leaves too few candidates (fewer than k, or less than top_p of the mass) is lowered; the last
# (0) takes the whole row, so the cutoff is always exact. At temperature ~0.7 a 49k vocabulary's nucleus
# lies well above 1e-4 of the top token's probability: one argsort of a few hundred logits instead of 49k.
CANDIDATE_FLOORS = (1e-4, 1e-6, 1e-8, 0.0)


def _cutoff(scaled: np.ndarray, e: np.ndarray, min_p: float, k: int, top_p: float) -> float:
    """The smallest scaled logit one row keeps under top-k (k: 0 for none) and top-p; `e` is exp(scaled)."""
    for floor in CANDIDATE_FLOORS:
        ids = np.flatnonzero(e >= floor)  # the top logits (exp never decreases), ties included
        if ids.size < k:
            continue
        cut = -np.inf
        if k:
            cut = -np.partition(-scaled[ids], k - 1)[k - 1]  # the k-th largest: a selection, not a sort
            ids = ids[scaled[ids] >= cut]  # top-k's survivors, ties at the k-th included
        if top_p >= 1.0:
            return float(cut)
        ids = ids[np.argsort(-scaled[ids])]  # any order of ties: the cutoff is a value
        kept = np.where(e[ids] >= min_p, e[ids], 0.0).astype(np.float64)
        complete = k > 0 or ids.size == scaled.size  # the candidates hold every token top-p may keep
        mass = kept.sum() if complete else e.sum(where=e >= min_p, dtype=np.float64)
        cdf = np.cumsum(kept)
        last = np.count_nonzero(cdf < top_p * mass)  # the first candidate at which the kept mass reaches top_p
        if last < cdf.size or complete:
            return float(max(cut, scaled[ids[min(last, cdf.size - 1)]]))
    raise AssertionError("unreachable: the last floor takes the whole row")


BLOCK = 256  # ids per block of inverse_cdf's first level


def inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Row r's token: the first id, in id order, at which the running sum of probs[r] (>= 0, not
    normalized) exceeds u[r] times the row's sum. In two levels, float64: sums per block of BLOCK ids,
    then the running sum inside the chosen block, so a draw reads the row twice instead of scanning it.
    A token with probability 0 is never drawn (u * sum may round up to the sum: the last nonzero stays)."""
    r, v = probs.shape
    nb = ceil_div(v, BLOCK)
    padded = probs if v == nb * BLOCK else np.pad(probs, ((0, 0), (0, nb * BLOCK - v)))
    blocks = padded.reshape(r, nb, BLOCK)
    sums = blocks.sum(axis=2, dtype=np.float64)
    cum = np.cumsum(sums, axis=1)
    target = u * cum[:, -1]
    rows = np.arange(r)
    b = np.minimum(np.count_nonzero(cum <= target[:, None], axis=1), _last_nonzero(sums))
    inside = blocks[rows, b]
    running = np.where(b > 0, cum[rows, b - 1], 0.0)[:, None] + np.cumsum(inside, axis=1, dtype=np.float64)
    pos = np.minimum(np.count_nonzero(running <= target[:, None], axis=1), _last_nonzero(inside))
    return b * BLOCK + pos


def _last_nonzero(x: np.ndarray) -> np.ndarray:
    """[R]: each row's last index holding a nonzero (every row has one)."""
    return x.shape[1] - 1 - np.argmax(x[:, ::-1] > 0, axis=1)


def apply_penalties(logits: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
    """float32 logits with each row's logit_bias added, then repetition, frequency and presence penalties
    (vLLM's order).

    Never writes to the caller's array.
    """
    rows = [i for i, s in enumerate(states) if s.penalized]
    biased = [i for i, s in enumerate(states) if s.bias_ids.size]
    if not rows and not biased:
        return np.asarray(logits, dtype=np.float32)
    x = np.array(logits, dtype=np.float32)
    for i in biased:
        x[i, states[i].bias_ids] += states[i].bias_values
    if not rows:
        return x
    counts = np.stack([states[i].output_counts for i in rows]).astype(np.float32)
    seen = np.stack([states[i].seen for i in rows])
    rep, freq, pres = (
        np.array([getattr(states[i].params, name) for i in rows], dtype=np.float32)[:, None]
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
    )
    xr = x[rows]
    xr = np.where(seen, np.where(xr > 0, xr / rep, xr * rep), xr)
    x[rows] = xr - freq * counts - pres * (counts > 0)
    return x


def _check(logits: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
    logits = np.asarray(logits)
    check_batch(logits.shape, states)
    return logits


def token_logprobs(x: np.ndarray, token_ids: np.ndarray, states: Sequence[SamplingState]) -> list[TokenLogprobs | None]:
    """Per row whose params ask for logprobs: the log-softmax of penalized logits `x` at token_ids[i], and the top-n."""
    out: list[TokenLogprobs | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if rows:
        ns = [states[i].params.logprobs or 0 for i in rows]
        for i, lp in zip(rows, _logprobs(x[rows], token_ids[rows], ns), strict=True):
            out[i] = lp
    return out


def prompt_logprobs(logits: np.ndarray, token_ids: Sequence[int], n: int) -> list[TokenLogprobs]:
    """Row i's log-softmax at token_ids[i] and its top-n: the raw logits' (no penalty, temperature or grammar
    applies to a prompt), as vLLM's prompt_logprobs. Float64 sums, chunked: a long prompt's rows need not all be
    converted at once."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out: list[TokenLogprobs] = []
    for start in range(0, len(ids), _SCORE_ROWS):
        rows = slice(start, start + _SCORE_ROWS)
        out += _logprobs(np.asarray(logits[rows], dtype=np.float32), ids[rows], [n] * len(ids[rows]))
    return out


_SCORE_ROWS = 256  # rows of prompt logits normalized at once (256 x a 150k vocabulary: ~150 MB of float32)


def _logprobs(x: np.ndarray, token_ids: np.ndarray, ns: Sequence[int]) -> list[TokenLogprobs]:
    """Row r's log-softmax at token_ids[r] and its top-ns[r] (logprob descending, ties to the lower id)."""
    # log-softmax = shifted - lse, taken only where it is read (the token, the candidates): no [R, V] array of it.
    shifted = x - x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=1, keepdims=True, dtype=np.float64))
    n_max = min(max(ns, default=0), x.shape[1])
    if n_max == 1:  # (lm-eval's scoring asks for one: an argmax, not a partition)
        cand = shifted.argmax(axis=1)[:, None]
    elif n_max:
        cand = np.argpartition(-shifted, n_max - 1, axis=1)[:, :n_max]
    else:
        cand = np.zeros((len(x), 0), np.int64)
    cand_lp = (np.take_along_axis(shifted, cand, axis=1) - lse).astype(np.float32)
    ranked = np.lexsort((cand, -cand_lp), axis=-1)  # logprob descending, ties to the lower id
    cand, cand_lp = np.take_along_axis(cand, ranked, axis=1), np.take_along_axis(cand_lp, ranked, axis=1)
    token_lp = (shifted[np.arange(len(x)), token_ids] - lse[:, 0]).astype(np.float32)
    out = []
    for r, (n, tok) in enumerate(zip(ns, token_ids.tolist(), strict=True)):
        top = [(int(t), float(v)) for t, v in zip(cand[r, :n].tolist(), cand_lp[r, :n].tolist(), strict=True)]
        out.append(TokenLogprobs(int(tok), float(token_lp[r]), top))
    return out

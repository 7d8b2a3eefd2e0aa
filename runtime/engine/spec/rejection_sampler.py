"""Verify draft tokens against the target's logits: exact speculative sampling in numpy, vectorized
across requests (the one-hot path loops over the <= k + 1 draft positions).

Per request with drafts d_1..d_k the backend returns k + 1 logits rows: row j is the target's
distribution p_j for the token after d_1..d_j (row 0: after the request's last real token).
Row j is turned into p_j exactly as the normal sampler would (penalties counting d_1..d_j as
output, temperature, min-p, top-k, top-p: executors/sampling/numpy_sampler.py).

Drafts with a one-hot q (the n-gram and draft-engine proposers: deterministic guesses) use the
coupled form of the rule: each row draws its token x_j from p_j exactly as the normal sampler
draws (same uniform stream, same inverse CDF); d_{j+1} is accepted iff x_j == d_{j+1}, and the
first x_j that differs is emitted. That is speculative sampling for one-hot q (accept d with
probability p(d) = min(1, p(d)/q(d)); after a rejection x is distributed as max(0, p - q)
renormalized), and the request's generator advances one draw per emitted token, as without
speculation: a seeded request samples the same tokens with speculation on or off, whatever its
batch (up to float rounding: a verify row and a decode row are computed in different calls).
Greedy rows take the argmax and draw nothing.

Drafts with a full distribution q (`draft_probs`) use the general rule: accept d_{j+1} with
probability min(1, p_j(d) / q_j(d)); at the first rejection draw from the residual
max(0, p_j - q_j) renormalized; when all k are accepted, draw a bonus token from p_k (Leviathan et
al. 2023; Chen et al. 2023). Logprobs of every emitted token are the target's (row j's penalized
log-softmax).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from executors.sampling import Sampler, SamplingState, TokenLogprobs
from executors.sampling.grammar import apply_bitmask, grammar_rows
from executors.sampling.numpy_sampler import apply_penalties, draw, token_logprobs


@dataclass(frozen=True)
class VerifyResult:
    token_ids: list[list[int]]  # per request: its accepted drafts, then the target's own token
    num_accepted: np.ndarray  # [R] int64: accepted drafts per request
    logprobs: list[list[TokenLogprobs] | None]  # per request, per emitted token; None unless asked


class RejectionSampler:
    def __init__(self) -> None:
        self.sampler = Sampler()

    def verify(
        self,
        logits: np.ndarray,
        drafts: Sequence[Sequence[int]],
        states: Sequence[SamplingState],
        draft_probs: Sequence[np.ndarray | None] | None = None,
        rows: np.ndarray | None = None,
    ) -> VerifyResult:
        """logits: [sum(len(d) + 1), V], request after request, or any rows of which `rows` picks those.
        draft_probs[i]: q of request i, [len(d_i), V] over the vocabulary after the same sampling
        transforms as p (None: one-hot)."""
        counts = np.array([len(d) for d in drafts], np.int64)
        starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).astype(np.int64)
        needed = int((counts + 1).sum())
        if logits.ndim != 2 or (logits.shape[0] if rows is None else len(rows)) != needed:
            raise ValueError(f"logits must be [{needed}, vocab] for drafts of {counts.tolist()}")
        if grammar_rows(states):  # structured output: row j masked by the grammar after d_1..d_j
            logits, rows = _grammar_masked(logits if rows is None else logits[rows], drafts, states, starts), None
        probs = [] if draft_probs is None else list(draft_probs)
        one_hot = all(q is None for q in probs)
        if one_hot and all(s.argmax_only for s in states):
            tokens = np.argmax(logits, axis=1)  # every row's token is its argmax (no gather of the rows first)
            num_accepted, final = _accept_argmax(tokens if rows is None else tokens[rows], drafts, counts, starts)
            return VerifyResult([[*d[:n], int(f)] for d, n, f in zip(drafts, num_accepted, final, strict=True)],
                                num_accepted, [None] * len(states))  # fmt: skip
        if rows is not None:
            logits = logits[rows]
        row_states = [s for i, state in enumerate(states) for s in _row_states(state, drafts[i])]
        if one_hot:
            num_accepted, final = self._coupled(logits, row_states, states, drafts, starts)
        else:
            num_accepted, final = self._general(logits, row_states, states, drafts, probs, starts)
        tokens = [[*drafts[i][: num_accepted[i]], int(final[i])] for i in range(len(states))]
        return VerifyResult(tokens, num_accepted, self._logprobs(logits, row_states, starts, tokens))

    def _coupled(
        self, logits: np.ndarray, row_states: Sequence[SamplingState], states: Sequence[SamplingState],
        drafts: Sequence[Sequence[int]], starts: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """One-hot q: position by position, every request still verifying draws its token as the
        normal sampler would (argmax, or the next uniform of its stream through the same inverse
        CDF) and keeps going while that token is its draft. Rows past a request's first mismatch
        are never sampled, so it draws once per emitted token, as without speculation."""
        counts = np.array([len(d) for d in drafts], np.int64)
        num_accepted = np.zeros(len(states), np.int64)
        final = np.zeros(len(states), np.int64)
        active = np.arange(len(states))
        for j in range(int(counts.max(initial=0)) + 1):
            rows = starts[active] + j
            picked = [row_states[r] for r in rows]
            x = apply_penalties(logits[rows], picked)
            tokens = np.argmax(x, axis=1).astype(np.int64)
            rand = np.flatnonzero([not states[i].params.greedy for i in active])
            if rand.size:
                u = np.array([states[active[n]].rng.random() for n in rand])
                tokens[rand] = draw(x[rand], [picked[n].params for n in rand], u)
            going = np.array([j < counts[i] and tokens[n] == drafts[i][j] for n, i in enumerate(active)], bool)
            num_accepted[active[going]] += 1
            final[active[~going]] = tokens[~going]
            active = active[going]
        return num_accepted, final

    def _general(
        self, logits: np.ndarray, row_states: Sequence[SamplingState], states: Sequence[SamplingState],
        drafts: Sequence[Sequence[int]], draft_probs: Sequence[np.ndarray | None], starts: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """min(1, p/q) acceptance, then the residual or the bonus: (accepted per request, final tokens)."""
        counts = np.array([len(d) for d in drafts], np.int64)
        width = max(int(counts.max(initial=0)), 1)
        draft_mat = _draft_matrix(drafts, width)
        valid = np.arange(width)[None, :] < counts[:, None]  # [R, K]
        row_of = np.where(valid, starts[:, None] + np.arange(width)[None, :], 0)  # row of p_j, j < k
        p = self.sampler.distribution(logits, row_states)  # [N, V] float64; greedy rows one-hot
        p_draft = p[row_of, np.maximum(draft_mat, 0)]  # [R, K]: p_j(d_{j+1})
        q_draft = np.ones_like(p_draft)
        for i, q in enumerate(draft_probs):
            if q is not None and counts[i]:
                q_draft[i, : counts[i]] = q[np.arange(counts[i]), drafts[i]]
        u = np.zeros_like(p_draft)
        for i, state in enumerate(states):  # one stream per request: independent of the batch
            if not state.params.greedy:
                u[i, : counts[i]] = state.rng.random(counts[i])
        ratio = np.divide(p_draft, q_draft, out=np.zeros_like(p_draft), where=q_draft > 0)
        accept = valid & (u < ratio)  # greedy: u = 0 accepts exactly when p(d) = 1
        num_accepted = np.cumprod(accept, axis=1).sum(axis=1).astype(np.int64)
        final_row = starts + num_accepted
        dist = p[final_row].copy()  # [R, V]: the bonus p_k, or below the residual at the first rejection
        for i in np.flatnonzero(num_accepted < counts):
            j = int(num_accepted[i])
            q = draft_probs[i]
            if q is None:
                q_row = np.zeros(dist.shape[1])
                q_row[drafts[i][j]] = 1.0
            else:
                q_row = q[j]
            dist[i] = residual(dist[i], q_row)
        u_final = np.array([0.0 if s.params.greedy else s.rng.random() for s in states])
        cdf = np.cumsum(dist, axis=1)
        pick = np.count_nonzero(cdf <= (u_final * cdf[:, -1])[:, None], axis=1)
        last = dist.shape[1] - 1 - np.argmax(dist[:, ::-1] > 0, axis=1)  # u * mass may round up to the mass
        return num_accepted, np.minimum(pick, last)

    def _logprobs(
        self, logits: np.ndarray, row_states: Sequence[SamplingState], starts: np.ndarray, tokens: list[list[int]]
    ) -> list[list[TokenLogprobs] | None]:
        if all(s.params.logprobs is None for s in row_states):
            return [None] * len(tokens)
        rows = np.concatenate([starts[i] + np.arange(len(t)) for i, t in enumerate(tokens)])
        emitted = np.concatenate([np.asarray(t, np.int64) for t in tokens])
        picked = [row_states[r] for r in rows]
        lps = token_logprobs(apply_penalties(logits[rows], picked), emitted, picked)
        out: list[list[TokenLogprobs] | None] = []
        at = 0
        for t in tokens:
            chunk = lps[at : at + len(t)]
            at += len(t)
            out.append(None if chunk[0] is None else [lp for lp in chunk if lp is not None])
        return out


def _draft_matrix(drafts: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[R, width] int64: request i's drafts in row i, -1 past them."""
    out = np.full((len(drafts), width), -1, np.int64)
    for i, d in enumerate(drafts):
        out[i, : len(d)] = d
    return out


def _accept_argmax(
    tokens: np.ndarray, drafts: Sequence[Sequence[int]], counts: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy verification from every row's argmax `tokens`: the drafts accepted while they equal the
    argmax of the row before them, then that row's argmax."""
    width = int(counts.max(initial=0))
    draft_mat = _draft_matrix(drafts, width)
    rows = np.minimum(starts[:, None] + np.arange(width)[None, :], len(tokens) - 1)  # row j: the token after d_j
    agree = (draft_mat == tokens[rows]) & (np.arange(width)[None, :] < counts[:, None])
    num_accepted = np.cumprod(agree, axis=1).sum(axis=1).astype(np.int64)
    return num_accepted, tokens[starts + num_accepted].astype(np.int64)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Where to draw after rejecting a draft: max(0, p - q) (unnormalized: the draw normalizes).
    When p == q up to rounding, rejection had probability ~0 and p itself is returned."""
    out = np.maximum(p - q, 0.0)
    return out if out.sum() > 0 else p


def _grammar_masked(
    logits: np.ndarray, drafts: Sequence[Sequence[int]], states: Sequence[SamplingState], starts: np.ndarray
) -> np.ndarray:
    """`logits` (request after request, k + 1 rows each) with each grammar request's rows masked: row j by the
    bitmask after its drafts d_1..d_j (GrammarState.draft_masks, which leaves the matcher where it was). A draft
    the grammar refuses cannot be drawn from the row before it, so it is rejected there."""
    rows: list[int] = []
    masks: list[np.ndarray] = []
    for i in grammar_rows(states):
        masks.append(states[i].grammar.draft_masks(drafts[i]))  # type: ignore[union-attr]
        rows.extend(range(int(starts[i]), int(starts[i]) + len(drafts[i]) + 1))
    return apply_bitmask(logits, rows, np.concatenate(masks))


def _row_states(state: SamplingState, drafts: Sequence[int]) -> list[SamplingState]:
    """The sampling state of each verify row: row j sees d_1..d_j as already generated (penalties). Without
    the grammar: its masks are already in the logits (_grammar_masked), and rows must not advance its matcher."""
    if state.grammar is not None:
        state = copy.copy(state)
        state.grammar = None
    if not state.penalized:
        return [state] * (len(drafts) + 1)
    rows = [state]
    for token in drafts:
        row = copy.copy(rows[-1])
        row.output_counts, row.seen = row.output_counts.copy(), row.seen.copy()
        row.append(token)
        rows.append(row)
    return rows

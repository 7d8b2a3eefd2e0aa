"""Sampling on the device: numpy_sampler.py's semantics over torch tensors (the GPU backends'
`step_sample`: executors/torch/, executors/tensorrt.py).

The same steps in the same order and precision as the numpy sampler: logit biases, penalties (repetition,
then frequency and presence, float32), temperature, min-p, top-k, top-p over the renormalized
survivors (each a cutoff value, cumulative sums in float64), one inverse-CDF draw per random row over
the kept tokens in id order (the same two levels of blocks); logprobs are the float32 log-softmax of
the penalized logits, top-n by logprob with ties to the lower id.
Only token ids (and the requested logprobs) come back to the host, not [batch, vocab] logits.

Seeds: each request's uniform is drawn on the host from its own numpy Generator (the
SamplingState's `rng`, one `random()` per random row per step, exactly the numpy sampler's
call), then moved to the device with the other per-row parameters in one small copy. So a
seeded request gives the same tokens on either sampler and whatever shares its batch.
Penalty state crosses as (row, token, count) triples of the tokens seen so far, not [B, V].

Where the two can differ: float32 `exp` may round differently by an ulp between numpy and
torch (and CUDA), and float64 sums may add in another order, which moves a draw only if the uniform
lands within ~1e-7 of a boundary of the cumulative distribution (or top-p's mass within as much of
top_p). The order of equal logits never matters: every filter keeps whole groups of ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine_format import ceil_div
from executors.sampling.grammar import grammar_rows
from executors.sampling.numpy_sampler import BLOCK
from executors.sampling.params import SamplingParams
from executors.sampling.state import FLOAT32_TINY, DeviceSample, SampleResult, SamplingState, TokenLogprobs, check_batch


class TorchSampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sample_rows(self, logits: torch.Tensor, rows: Sequence[SamplingState | None]) -> DeviceSample:
        """Row i sampled with rows[i]; rows that are None get token -1 (not sampled)."""
        picked = [i for i, r in enumerate(rows) if r is not None]
        token_ids = np.full(len(rows), -1, np.int64)
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if picked:
            sub = logits if len(picked) == len(rows) else logits[self._index(picked)]
            result = self.sample(sub, [r for r in rows if r is not None])
            token_ids[picked] = result.token_ids
            for j, i in enumerate(picked):
                logprobs[i] = result.logprobs[j]
        return DeviceSample(token_ids, logprobs)

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SamplingState | None]) -> torch.Tensor:
        """`sample_rows`' tokens left on the device ([B] int64, -1 where rows[i] is None), for an overlapped step:
        nothing is read back. Rows without penalties, grammars, logprobs or a logit bias only (host_sampled)."""
        picked: list[int] = []  # the rows sampled, one pass over the batch (every overlapped step's)
        states: list[SamplingState] = []
        rand: list[int] = []  # which of `states` draw at random
        for i, r in enumerate(rows):
            if r is None:
                continue
            if r.host_sampled:
                raise ValueError("a row with penalties, a grammar, logprobs or a bias is sampled with sample_rows, "
                                 "not left on the device")  # fmt: skip
            if not r.params.greedy:
                rand.append(len(states))
            picked.append(i)
            states.append(r)
        tokens = torch.full((len(rows),), -1, dtype=torch.int64, device=logits.device)
        if not picked:
            return tokens
        x = (logits if len(picked) == len(rows) else logits[self._index(picked)]).float()
        chosen = x.argmax(dim=1)
        if rand:
            u = np.array([states[j].rng.random() for j in rand])  # drawn now, in step order: the same stream
            index = self._index(rand)
            chosen[index] = self._draw(x[index], [states[j].params for j in rand], u)
        tokens[self._index(picked)] = chosen
        return tokens

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingState]) -> SampleResult:
        """The numpy Sampler.sample of the same logits and states: one token per row (and its logprobs)."""
        check_batch(tuple(logits.shape), rows)
        logits = self._masked(logits, rows)  # structured output: -inf where a grammar refuses
        greedy = np.array([r.params.greedy for r in rows], dtype=bool)
        if all(r.argmax_only for r in rows):
            return SampleResult(logits.argmax(dim=1).cpu().numpy().astype(np.int64), [None] * len(rows))
        x = self._penalized(logits, rows)
        token_ids = x.argmax(dim=1)
        rand = np.flatnonzero(~greedy)
        if rand.size:
            u = np.array([rows[i].rng.random() for i in rand])  # one draw per row from its own stream
            index = self._index(rand.tolist())
            token_ids[index] = self._draw(x[index], [rows[i].params for i in rand], u)
        logprobs = self._logprobs(x, token_ids, rows)
        return SampleResult(token_ids.cpu().numpy().astype(np.int64), logprobs)

    def _masked(self, logits: torch.Tensor, rows: Sequence[SamplingState]) -> torch.Tensor:
        """grammar.mask_logits on the device: the grammar rows' bitmasks (filled on the host) cross in one copy
        and are unpacked there; `logits` itself when no row has a grammar."""
        picked = grammar_rows(rows)
        if not picked:
            return logits
        host = np.stack([rows[i].grammar.mask() for i in picked])  # type: ignore[union-attr]
        bitmask = self._upload(host)
        vocab = torch.arange(logits.shape[1], device=self.device)
        allowed = ((bitmask[:, vocab >> 5] >> (vocab & 31)) & 1).bool()  # int32 >> is arithmetic: & 1 after
        out = logits.float().clone()
        index = self._index(picked)
        out[index] = torch.where(allowed, out[index], torch.full_like(out[index], -torch.inf))
        return out

    def _index(self, rows: list[int]) -> torch.Tensor:
        return self._upload(np.array(rows, np.int64))

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        """A host array on the device without waiting for the device: a plain `.to(device)` synchronizes the
        stream after the copy, so an overlapped launch would wait for the step before it to finish. (CUDA
        stages pageable memory before the call returns: `host` may be freed at once.)"""
        return torch.from_numpy(host).to(self.device, non_blocking=True)

    def _penalized(self, logits: torch.Tensor, rows: Sequence[SamplingState]) -> torch.Tensor:
        """float32 logits with the logit biases, then the penalties applied (a copy when any row has one)."""
        penalized = [i for i, r in enumerate(rows) if r.penalized]
        biased = [i for i, r in enumerate(rows) if r.bias_ids.size]
        if not penalized and not biased:
            return logits.float()
        x = logits.float().clone()
        if biased:  # (row, token) pairs are distinct: a plain indexed add
            bias_rows = np.repeat(biased, [rows[i].bias_ids.size for i in biased]).astype(np.int64)
            ids = np.concatenate([rows[i].bias_ids for i in biased])
            values = self._upload(np.concatenate([rows[i].bias_values for i in biased]))
            x[self._upload(bias_rows), self._upload(ids)] += values
        if not penalized:
            return x
        seen = [np.flatnonzero(rows[i].seen) for i in penalized]  # prompt and output tokens
        entries = np.stack([
            np.repeat(np.arange(len(penalized)), [len(s) for s in seen]),
            np.concatenate(seen),
            np.concatenate([rows[i].output_counts[s] for i, s in zip(penalized, seen, strict=True)]),
        ]).astype(np.int64)  # fmt: skip
        params = np.array([[rows[i].params.repetition_penalty, rows[i].params.frequency_penalty,
                            rows[i].params.presence_penalty] for i in penalized], np.float32)  # fmt: skip
        r, tok, cnt = self._upload(entries).unbind(0)
        rep, freq, pres = self._upload(params)[:, :, None].unbind(1)
        shape = (len(penalized), x.shape[1])
        is_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        is_seen[r, tok] = True
        counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
        counts[r, tok] = cnt.float()
        index = self._index(penalized)
        xr = x[index]
        xr = torch.where(is_seen, torch.where(xr > 0, xr / rep, xr * rep), xr)
        x[index] = xr - freq * counts - pres * (counts > 0).float()
        return x

    def _draw(self, x: torch.Tensor, params: Sequence[SamplingParams], u: np.ndarray) -> torch.Tensor:
        """numpy `draw`: the filtered distribution, then the inverse-CDF draw, for rows x [R, V] and their
        uniforms u [R]."""
        return _inverse_cdf(self._filtered(x, params), self._upload(u.astype(np.float64)))

    def _filtered(self, x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """numpy `filtered_probs`: [R, V] float32 probabilities relative to each row's top token, 0 where
        min-p, top-k or top-p drop a token. The cutoffs are the same values; rows with top-k or top-p sort
        whole on the device (the numpy sampler sorts candidates: a cutoff does not depend on the order)."""
        v = x.shape[1]
        host = np.array([[p.temperature, p.min_p, p.top_p, p.top_k if 0 < p.top_k < v else v]
                         for p in params], np.float64)  # fmt: skip
        temp, min_p, top_p, top_k = self._upload(host).unbind(1)
        scaled = (x - x.max(dim=1, keepdim=True).values) / temp.clamp(min=FLOAT32_TINY).float()[:, None]
        e = torch.exp(scaled)  # prob / max_prob; the top token lands on exactly 0, its prob on 1
        probs = torch.where(e.double() >= min_p[:, None], e, 0.0)  # compared in float64 as numpy promotes
        cut = [i for i, p in enumerate(params) if 0 < p.top_k < v or p.top_p < 1.0]  # known on the host: no sync
        if cut:
            index = self._index(cut)
            sub, k, p = scaled[index], top_k[index].long()[:, None], top_p[index]
            ranked, order = torch.sort(sub, dim=1, descending=True)
            cut_k = ranked.gather(1, k - 1)  # k = V for no top-k: the smallest logit, which keeps every token
            kept = torch.where(ranked >= cut_k, probs[index].gather(1, order), 0.0).double()
            cdf = torch.cumsum(kept, dim=1)
            last = (cdf < (p * kept.sum(dim=1))[:, None]).sum(dim=1).clamp(max=v - 1)
            cut_p = torch.where(p[:, None] < 1.0, ranked.gather(1, last[:, None]), -torch.inf)
            probs[index] = torch.where(sub >= torch.maximum(cut_k, cut_p), probs[index], 0.0)
        return probs

    def _logprobs(self, x: torch.Tensor, token_ids: torch.Tensor,
                  rows: Sequence[SamplingState]) -> list[TokenLogprobs | None]:  # fmt: skip
        out: list[TokenLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return out
        index = self._index(want)
        xr = x[index]
        shifted = xr - xr.max(dim=1, keepdim=True).values
        lse = torch.log(torch.exp(shifted).double().sum(dim=1, keepdim=True))
        lp = (shifted.double() - lse).float()
        n_max = min(max(rows[i].params.logprobs or 0 for i in want), x.shape[1])
        values, ids = torch.sort(lp, dim=1, descending=True, stable=True)  # ties to the lower id
        chosen = lp.gather(1, token_ids[index][:, None])[:, 0]
        top_ids, top_lp, chosen_lp = ids[:, :n_max].cpu().tolist(), values[:, :n_max].cpu().tolist(), chosen.tolist()
        tokens = token_ids[index].cpu().tolist()
        for r, i in enumerate(want):
            n = rows[i].params.logprobs or 0
            out[i] = TokenLogprobs(int(tokens[r]), float(chosen_lp[r]),
                                   list(zip(top_ids[r][:n], top_lp[r][:n], strict=True)))  # fmt: skip
        return out


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """numpy `inverse_cdf` on the device: per row, the first id whose running sum of probs exceeds u times
    the row's sum, in the same two levels (float64 sums per block of BLOCK ids, then inside the block)."""
    r, v = probs.shape
    nb = ceil_div(v, BLOCK)
    blocks = torch.nn.functional.pad(probs, (0, nb * BLOCK - v)).view(r, nb, BLOCK).double()
    sums = blocks.sum(dim=2)
    cum = torch.cumsum(sums, dim=1)
    target = (u * cum[:, -1])[:, None]
    rows = torch.arange(r, device=probs.device)
    b = torch.minimum((cum <= target).sum(dim=1), _last_nonzero(sums))
    inside = blocks[rows, b]
    base = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    running = base[:, None] + torch.cumsum(inside, dim=1)
    pos = torch.minimum((running <= target).sum(dim=1), _last_nonzero(inside))
    return b * BLOCK + pos


def _last_nonzero(x: torch.Tensor) -> torch.Tensor:
    return x.shape[1] - 1 - (x.flip(1) > 0).int().argmax(dim=1)

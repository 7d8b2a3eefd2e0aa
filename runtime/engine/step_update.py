"""After the backend ran a step, the per-step state transition (vLLM's update_from_output): advance computed
lengths, sample (or verify drafts), append the tokens, finish requests at a stop token or max_tokens, and
hand back each request's TokenOutput. An overlapped step is updated in two halves: at launch (`launched`:
computed lengths, a placeholder per sampled row) and once its tokens are known (`resolve`). With the
scheduler's admissions and preemptions, this is where a running request's state changes; the speculation and
disaggregation hooks ask them (a prefill-only request ends here with its first token, as "handoff": the
disaggregation hook pins its blocks and names them in the final output). Text (detokenization, stop strings)
is the output processor's, off this path.

The scheduler's: it reads and changes the scheduler's requests, queues and KV cache manager, under the
engine's lock; it owns the host sampler.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine_format.kv_handle import HANDOFF
from executors.device_sampling import PLACEHOLDER
from executors.sampling import DeviceSample, Sampler, SampleResult, TokenLogprobs, prompt_logprobs
from runtime.engine.outputs import RequestStats, TokenOutput
from runtime.engine.request import Request, RequestStatus
from runtime.engine.scheduler import Scheduler
from runtime.engine.spec.decoding import SpecDecoder
from runtime.engine.stats import EngineCounters
from runtime.engine.step_inputs import StepChunks

# An overlapped step's sampled row: (request, its row in the step's sample, the index of its placeholder token).
Placed = tuple[Request, int, int]  # as step_inputs.InFlight.placed


class StepUpdate:
    def __init__(self, scheduler: Scheduler, spec: SpecDecoder | None, counters: EngineCounters,
                 clock: Callable[[], float], itl_target_s: float | None,
                 kv_handle: Callable[[Request], str]) -> None:  # fmt: skip
        """`kv_handle`: the disaggregation hook that pins a prefill-only request's blocks for a decode worker
        and returns the handle's JSON (called as the request ends with HANDOFF, before its blocks are freed)."""
        self.scheduler, self.kv, self.spec = scheduler, scheduler.kv, spec
        self.counters, self.clock, self.itl_target_s = counters, clock, itl_target_s
        self.kv_handle = kv_handle
        self.sampler = Sampler()

    def run(self, step: StepChunks, logits: np.ndarray | DeviceSample) -> list[TokenOutput]:
        """The step's outputs; then the drafts of the next step are proposed."""
        to_sample: list[Request] = []
        rows: list[int] = []  # each sampled request's logits row
        to_verify: list[tuple[Request, int, list[int]]] = []
        block_size, finished, counters = self.kv.block_size, RequestStatus.FINISHED, self.counters
        row = 0  # the chunk's first logits row
        for request, chunk, completes in zip(step.requests, step.chunks, step.completes, strict=True):
            first_row, row = row, row + chunk.num_logits
            if request.status is finished:  # aborted while the backend ran
                continue
            n = len(chunk.token_ids)
            prefill = request.num_computed_tokens < request.num_prompt_tokens
            if prefill:
                counters.prompt_tokens += n
            if chunk.num_logits > 1:
                if prefill:  # a row per token: the prompt's logprobs (build_chunks: never with drafts)
                    assert isinstance(logits, np.ndarray), "scoring steps return host logits"
                    score_prompt(request, chunk.past_len, logits[first_row:row])
                else:  # computed length advances by the accepted tokens only (_verify)
                    to_verify.append((request, first_row, list(chunk.token_ids[n + 1 - chunk.num_logits :])))
                    continue
            request.num_computed_tokens += n
            if request.num_computed_tokens >= (request.num_cached_blocks + 1) * block_size:  # a block filled
                self.kv.cache_computed_blocks(request)
            if completes:
                to_sample.append(request)
                rows.append(row - 1)
        outputs = self._sample(to_sample, rows, logits)
        if to_verify:
            assert isinstance(logits, np.ndarray), "verify steps return host logits"
            outputs += self._verify(to_verify, logits)
        if self.spec is not None:
            live = to_sample + [r for r, _, _ in to_verify]
            self.spec.propose(live, self.scheduler.running, self.scheduler.num_waiting)
        return outputs

    def _verify(self, to_verify: list[tuple[Request, int, list[int]]], logits: np.ndarray) -> list[TokenOutput]:
        """Keep each request's accepted drafts plus one token; roll the rest back."""
        assert self.spec is not None
        now, outputs = self.clock(), []
        for request, tokens, logprobs, accepted in self.spec.verify(logits, to_verify):
            request.num_computed_tokens = request.num_tokens + accepted  # tokens so far hold K/V, plus accepted
            outputs.append(self._append_tokens(request, tokens, logprobs, now))
            if not request.is_finished:
                self.kv.trim(request)  # blocks that held only rejected drafts go back to the pool
                self.kv.cache_computed_blocks(request)
        return outputs

    def _sample(self, requests: list[Request], rows: list[int], logits: np.ndarray | DeviceSample) -> list[TokenOutput]:
        if not requests:
            return []
        if isinstance(logits, DeviceSample):  # sampled by the backend
            rows_logprobs = logits.logprobs
            picked_logprobs: list[TokenLogprobs | None] = (
                [rows_logprobs[row] for row in rows] if any(rows_logprobs) else [None] * len(rows)
            )
            result = SampleResult(logits.token_ids[rows], picked_logprobs)
        else:
            result = self.sampler.sample(logits[rows], [r.sampling for r in requests])
        now, outputs = self.clock(), []
        for request, token, logprobs in zip(requests, result.token_ids.tolist(), result.logprobs, strict=True):
            tokens = request.all_token_ids  # _append_tokens of one token, inlined: every step's per-request path
            tokens.append(token)
            lp = None if logprobs is None else [logprobs]
            num_output = len(tokens) - request.num_prompt_tokens
            reason = self._took(request, token, num_output, now)
            if reason is None:
                out = TokenOutput(request.request_id, [token], lp, request.num_prompt_tokens, num_output)
            else:
                out = self.finish(request, reason, [token], lp)
            if num_output == 1 and request.prompt_logprobs is not None:  # the first token's output carries them
                out.prompt_logprobs = request.prompt_logprobs
            outputs.append(out)
        return outputs

    def _append_tokens(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None, now: float
    ) -> TokenOutput:
        """Append a step's tokens (one, or accepted drafts + one) in order, up to the first that
        finishes the request (a stop token, max_tokens); one output carries them all."""
        for i, token in enumerate(tokens):
            request.all_token_ids.append(token)
            reason = self._took(request, token, len(request.all_token_ids) - request.num_prompt_tokens, now)
            if reason is not None:
                return self.finish(request, reason, tokens[: i + 1], None if logprobs is None else logprobs[: i + 1])
        return _output(request, tokens, logprobs)

    def launched(self, step: StepChunks) -> list[Placed]:
        """An overlapped step was launched (its tokens sampled on the device, not yet known): computed lengths
        advance now, and each sampled row's request gets a placeholder token (the next step's decode takes the
        real one on the device; `resolve` writes it here)."""
        placed: list[Placed] = []
        for row, (request, chunk, completes) in enumerate(zip(step.requests, step.chunks, step.completes, strict=True)):
            if request.status is RequestStatus.FINISHED:  # aborted while it was launched: its row is dropped
                continue
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.counters.prompt_tokens += len(chunk.token_ids)
            request.num_computed_tokens += len(chunk.token_ids)
            if completes:
                placed.append((request, row, len(request.all_token_ids)))
                request.all_token_ids.append(PLACEHOLDER)
                request.pending_row = row
        return placed

    def resolve(self, placed: list[Placed], sample: DeviceSample) -> list[TokenOutput]:
        """An overlapped step's tokens, now known: each replaces its request's placeholder (and a request that
        finishes drops the placeholders of the steps launched after it: their tokens are never output)."""
        now, outputs, block_size = self.clock(), [], self.kv.block_size
        tokens, finished = sample.token_ids.tolist(), RequestStatus.FINISHED
        for request, row, index in placed:
            if request.status is finished:  # aborted, or finished by an earlier token, meanwhile
                continue
            token = tokens[row]
            request.all_token_ids[index] = token
            if request.num_computed_tokens >= (request.num_cached_blocks + 1) * block_size:  # a block filled,
                self.kv.cache_computed_blocks(request)  # its tokens all known now
            num_output = index + 1 - request.num_prompt_tokens  # (not counting a later step's placeholder)
            reason = self._took(request, token, num_output, now)
            if reason is not None:
                del request.all_token_ids[index + 1 :]
                outputs.append(self.finish(request, reason, [token]))
            else:
                outputs.append(TokenOutput(request.request_id, [token], None, request.num_prompt_tokens, num_output))
        return outputs

    def _took(self, request: Request, token: int, num_output: int, now: float) -> str | None:
        """Account a token just placed as the request's `num_output`-th; why it finishes the request, if it does.
        Once per request per step: only what every token needs, the rest behind a test."""
        timing, params, counters = request.timing, request.params, self.counters
        if request.sampling.tracks_tokens:
            request.sampling.append(token)
        last = timing.last_token
        if last is None:
            timing.first_token = now
            if params.ttft_target_s is not None:
                counters.record_latency("ttft", now - timing.arrival, params.ttft_target_s)
        else:
            timing.inter_token_latencies.append(now - last)
            target = params.itl_target_s or self.itl_target_s
            if target is not None:
                counters.record_latency("itl", now - last, target)
        timing.last_token = now
        counters.generation_tokens += 1
        if token in request.stop_token_ids:
            return "stop"
        if num_output >= request.max_tokens:
            return "length"
        return HANDOFF if request.prefill_only else None  # its first token: the decode worker goes on

    def finish(
        self,
        request: Request,
        reason: str,
        token_ids: list[int] | None = None,
        lp: list[TokenLogprobs] | None = None,
        error: str | None = None,
    ) -> TokenOutput:
        """End `request` now (its KV blocks freed, a handed-off one's pinned first); its final output."""
        kv_handle = self.kv_handle(request) if reason == HANDOFF else None
        self.scheduler.remove(request)
        if self.spec is not None:
            self.spec.release(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        request.timing.finished = self.clock()
        self.counters.finished[reason] += 1
        out = _output(request, token_ids or [], lp)
        out.finish_reason, out.error, out.kv_handle = reason, error, kv_handle
        out.stats = RequestStats(**request.timing.summary(), num_preemptions=request.num_preemptions)
        return out


def _output(request: Request, token_ids: list[int], lp: list[TokenLogprobs] | None) -> TokenOutput:
    return TokenOutput(request.request_id, token_ids, lp, request.num_prompt_tokens, request.num_output_tokens)


def score_prompt(request: Request, start: int, logits: np.ndarray) -> None:
    """Extend `request.prompt_logprobs` from a prefill chunk's logits rows: the row of position p scores prompt
    token p + 1 (rows of positions already scored, before a preemption, are skipped; the last prompt position's
    row predicts the first output token, which is sampled instead)."""
    scored = request.prompt_logprobs
    assert scored is not None
    first = len(scored) - 1 - start  # the first row not yet scored
    assert first >= 0, "a scoring prefill runs from the prompt's first unscored position (no cache hits)"
    last = min(len(logits), request.num_prompt_tokens - 1 - start)  # rows that score a prompt token
    if first >= last:
        return
    tokens = request.all_token_ids[start + first + 1 : start + last + 1]
    scored.extend(prompt_logprobs(logits[first:last], tokens, request.params.prompt_logprobs or 0))

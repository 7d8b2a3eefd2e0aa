"""After the backend ran a step: advance computed lengths, sample (or verify drafts), append the
tokens (stop tokens, incremental detokenization with stop strings, max_tokens), finish requests,
and build each request's output delta.

The engine calls it under its lock; it shares the engine's request and stream tables, scheduler,
KV cache manager and counters, and owns nothing but the sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from executors.sampling import DeviceSample, Sampler, SampleResult, TokenLogprobs
from runtime.engine.detokenizer import LOGPROB_CONTEXT_TOKENS, DetokenizedStream, candidate_texts
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.outputs import RequestOutput, RequestStats
from runtime.engine.request import Request, RequestStatus
from runtime.engine.scheduler import Scheduler
from runtime.engine.spec.decoding import SpecDecoder
from runtime.engine.stats import EngineCounters
from runtime.engine.step_inputs import ScheduledChunk


class Postprocessor:
    def __init__(
        self,
        requests: dict[str, Request],
        streams: dict[str, DetokenizedStream],
        scheduler: Scheduler,
        kv: KVCacheManager,
        spec: SpecDecoder | None,
        counters: EngineCounters,
        eos_token_ids: frozenset[int],
        clock: Callable[[], float],
        itl_target_s: float | None,
        tokenizer: Any,
    ) -> None:
        """`requests` / `streams`: the engine's live tables (finished requests leave both here); `tokenizer`:
        renders logprobs' candidate tokens as text."""
        self.tokenizer = tokenizer
        self.requests, self.streams, self.scheduler, self.kv, self.spec = requests, streams, scheduler, kv, spec
        self.counters, self.eos_token_ids, self.clock, self.itl_target_s = counters, eos_token_ids, clock, itl_target_s
        self.sampler = Sampler()

    def run(self, scheduled: list[ScheduledChunk], logits: np.ndarray | DeviceSample) -> list[RequestOutput]:
        """The step's outputs; then the drafts of the next step are proposed."""
        to_sample: list[tuple[Request, int]] = []
        to_verify: list[tuple[Request, int, list[int]]] = []
        for chunk in scheduled:
            request = chunk.request
            if request.is_finished:  # aborted while the backend ran
                continue
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.counters.prompt_tokens += chunk.num_tokens
            if chunk.drafts:  # computed length advances by the accepted tokens only (_verify)
                to_verify.append((request, chunk.first_row, chunk.drafts))
                continue
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed_blocks(request)
            if request.num_computed_tokens == request.num_tokens:
                to_sample.append((request, chunk.first_row))
        outputs = self._sample(to_sample, logits)
        if to_verify:
            assert isinstance(logits, np.ndarray), "verify steps return host logits"
            outputs += self._verify(to_verify, logits)
        if self.spec is not None:
            live = [r for r, _ in to_sample] + [r for r, _, _ in to_verify]
            self.spec.propose(live, self.scheduler.running, self.scheduler.num_waiting)
        return outputs

    def _verify(self, to_verify: list[tuple[Request, int, list[int]]], logits: np.ndarray) -> list[RequestOutput]:
        """Keep each request's accepted drafts plus one token; roll the rest back."""
        assert self.spec is not None
        now, outputs = self.clock(), []
        for request, tokens, logprobs in self.spec.verify(logits, to_verify):
            outputs.append(self._append_tokens(request, tokens, logprobs, now))
            if not request.is_finished:
                self.kv.trim(request)  # blocks that held only rejected drafts go back to the pool
                self.kv.cache_computed_blocks(request)
        return outputs

    def _sample(self, to_sample: list[tuple[Request, int]], logits: np.ndarray | DeviceSample) -> list[RequestOutput]:
        if not to_sample:
            return []
        requests = [r for r, _ in to_sample]
        picked = [row for _, row in to_sample]
        if isinstance(logits, DeviceSample):  # sampled by the backend
            result = SampleResult(logits.token_ids[picked], [logits.logprobs[row] for row in picked])
        else:
            result = self.sampler.sample(logits[picked], [r.sampling for r in requests])
        now = self.clock()
        return [
            self._append_tokens(request, [int(token)], None if logprobs is None else [logprobs], now)
            for request, token, logprobs in zip(requests, result.token_ids, result.logprobs, strict=True)
        ]

    def _append_tokens(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None, now: float
    ) -> RequestOutput:
        """Append a step's tokens (one, or accepted drafts + one) in order, up to the first that
        finishes the request; one output carries them all."""
        timing, params, stream = request.timing, request.params, self.streams[request.request_id]
        text = ""
        if logprobs is not None:  # each token's candidates as text, before the tokens are appended
            logprobs = self._with_texts(request, tokens, logprobs)
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            request.sampling.append(token)
            if timing.last_token is None:
                self.counters.record_latency("ttft", now - timing.arrival, params.ttft_target_s)
            else:
                self.counters.record_latency("itl", now - timing.last_token, params.itl_target_s or self.itl_target_s)
            timing.on_token(now)
            self.counters.generation_tokens += 1
            kept, lp = tokens[: i + 1], None if logprobs is None else logprobs[: i + 1]
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                return self.finish(request, "stop", text, kept, lp)  # the stop token's text is not output
            delta, stopped = stream.add(token)
            text += delta
            if stopped:
                return self.finish(request, "stop", text, kept, lp)
            if request.num_output_tokens >= request.max_tokens:
                return self.finish(request, "length", text, kept, lp)
        return _output(request, text, tokens, logprobs)

    def _with_texts(self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs]) -> list[TokenLogprobs]:
        context = request.all_token_ids[-LOGPROB_CONTEXT_TOKENS:]
        out = []
        for token, lp in zip(tokens, logprobs, strict=True):
            texts = candidate_texts(self.tokenizer, context, [lp.token_id, *(t for t, _ in lp.top)])
            out.append(replace(lp, texts=texts))
            context = [*context, token][-LOGPROB_CONTEXT_TOKENS:]
        return out

    def finish(
        self,
        request: Request,
        reason: str,
        text: str = "",
        token_ids: list[int] | None = None,
        lp: list[TokenLogprobs] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """End `request` now (its KV blocks freed, its stream flushed); its final output."""
        stream = self.streams.pop(request.request_id)
        text += stream.finish()
        self.scheduler.remove(request)
        del self.requests[request.request_id]
        if self.spec is not None:
            self.spec.release(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        request.timing.finished = self.clock()
        self.counters.finished[reason] += 1
        out = _output(request, text, token_ids or [], lp)
        out.finished, out.finish_reason, out.error = True, reason, error
        out.stats = RequestStats(**request.timing.summary(), num_preemptions=request.num_preemptions)
        return out


def _output(request: Request, text: str, token_ids: list[int], lp: list[TokenLogprobs] | None) -> RequestOutput:
    return RequestOutput(
        request.request_id, text, token_ids, logprobs=lp,
        num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
    )  # fmt: skip

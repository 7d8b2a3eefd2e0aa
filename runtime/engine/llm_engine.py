"""The engine loop: schedule -> run the backend -> sample -> detokenize and finish.

`LLMEngine` is synchronous and driven by `step()`; `add_request` and `abort` may be called
from other threads (the async engine does), so engine state is guarded by one lock that
is released while the backend runs. The scheduler never touches tensors and the backend
never makes scheduling decisions.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine_format import EngineConfig
from runtime.backends import DeviceSample, DeviceSampling, create_backend
from runtime.backends.base import EngineBackend
from runtime.engine.admission import Admission, Prompt
from runtime.engine.detokenizer import DetokenizedStream
from runtime.engine.engine_args import EngineArgs
from runtime.engine.errors import InvalidRequest, Overloaded
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.outputs import RequestOutput, RequestStats
from runtime.engine.request import Request, RequestStatus, RequestTiming
from runtime.engine.sampler import Sampler, SampleResult, SamplingState, TokenLogprobs
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.spec.decoding import create_spec_decoder
from runtime.engine.stats import EngineCounters, EngineStats, StepRecord
from runtime.engine.step_cost import OnlineStepCost, StepShape
from runtime.engine.step_inputs import ScheduledChunk, build_chunks
from runtime.engine.tokenizer import load_tokenizer, stop_token_ids

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        engine_dir: str | Path,
        args: EngineArgs | None = None,
        backend: EngineBackend | None = None,
        clock: Callable[[], float] = time.monotonic,
        cost_model: OnlineStepCost | None = None,
    ):
        """`clock` (seconds, monotonic) stamps arrivals, scheduling, tokens and finishes: deadlines,
        the timing stats and the step times the cost model learns from are read from it. Tests
        pass a fake clock they advance by hand. `cost_model`: default, learned from the prior."""
        args = args or EngineArgs()
        self.clock = clock
        self.cost_model = cost_model or OnlineStepCost()
        self.itl_target_s = None if args.itl_target_ms is None else args.itl_target_ms / 1000
        self.config = config = EngineConfig.load(engine_dir)
        # The backend before the tokenizer: the tokenizer loads transformers and with it torch's
        # libgomp, which must come after the attention kernel sets its OpenMP wait policy.
        self.backend = backend or create_backend(
            config, args.num_kv_blocks, args.threads, args.backend, args.max_num_batched_tokens
        )
        self.tokenizer = load_tokenizer(engine_dir)
        self.kv = KVCacheManager(self.backend.num_blocks, config.block_size, args.enable_prefix_caching)
        max_num_seqs = min(args.max_num_seqs or config.max_batch_size, config.max_batch_size)
        if args.max_num_batched_tokens < max_num_seqs:  # else some running decodes would starve
            raise ValueError(
                f"max_num_batched_tokens ({args.max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}): "
                "every running request needs one token per step"
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs, args.max_num_batched_tokens, args.max_waiting, self.itl_target_s, args.min_prefill_tokens
            ),
            self.kv,
            self.cost_model,
        )
        self.sampler = Sampler()
        self.spec = create_spec_decoder(args, config, max_num_seqs)
        self.admission = Admission(self.tokenizer, config.model.vocab_size, config.max_seq_len, self.kv.capacity_tokens)
        self.eos_token_ids = frozenset(stop_token_ids(self.tokenizer, config))
        self.requests: dict[str, Request] = {}
        self.streams: dict[str, DetokenizedStream] = {}
        self.counters = EngineCounters()
        self._lock = threading.RLock()
        self._arrivals = itertools.count()
        log.info(
            "KV cache: %d blocks x %d = %d tokens; max concurrency at max_seq_len %d: %.1f sequences "
            "(max_num_seqs %d)",
            self.kv.pool.num_blocks, config.block_size, self.kv.capacity_tokens, config.max_seq_len,
            self.kv.capacity_tokens / config.max_seq_len, max_num_seqs,
        )  # fmt: skip

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequest or Overloaded at once."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        try:
            prompt_ids = self.admission.tokenize(prompt)
            self.admission.check_fits(prompt_ids, params)
        except InvalidRequest:
            self.counters.rejected_invalid += 1
            raise
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already in use")
            request = Request(
                request_id=request_id,
                all_token_ids=prompt_ids,
                params=params,
                sampling=SamplingState(params, prompt_ids, self.config.model.vocab_size),
                arrival_order=next(self._arrivals),
                timing=RequestTiming(arrival=self.clock()),
            )
            stream = DetokenizedStream(
                self.tokenizer,
                prompt_ids,
                stops=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            )
            try:
                self.scheduler.add(request)  # raises Overloaded: queue full, or its TTFT target unreachable
            except Overloaded as exc:
                if exc.reason == "slo":
                    self.counters.rejected_slo += 1
                else:
                    self.counters.rejected_overloaded += 1
                raise
            except InvalidRequest:  # a TTFT target below the prompt's own prefill time
                self.counters.rejected_slo += 1
                raise
            self.requests[request_id], self.streams[request_id] = request, stream
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its KV blocks; None if it is not live."""
        with self._lock:
            request = self.requests.get(request_id)
            return None if request is None else self._finish(request, "abort", "", [], None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        step_start = self.clock()
        with self._lock:
            outputs = self._expire_deadlines()
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return outputs
            now = self.clock()
            for request in batch.num_tokens:
                request.timing.first_scheduled = request.timing.first_scheduled or now
            scheduled, chunks = build_chunks(batch.num_tokens)
            # Rows that complete their request's tokens are sampled: by the backend on its device if it can
            # (drafts are verified on the host, from logits of every draft position).
            rows = [s.request.sampling if s.completes else None for s in scheduled]
            verifying = any(s.drafts for s in scheduled)
        try:
            if isinstance(self.backend, DeviceSampling) and not verifying:  # lock released: add/abort proceed
                logits: np.ndarray | DeviceSample = self.backend.step_sample(chunks, rows)
            else:
                logits = self.backend.step(chunks)
        except Exception as exc:  # fail this step's requests, keep serving the others
            log.exception("backend step failed; finishing its %d requests with an error", len(chunks))
            with self._lock:
                failed = [s.request for s in scheduled if not s.request.is_finished]
                return outputs + [self._finish(r, "error", "", [], None, error=str(exc)) for r in failed]
        with self._lock:
            self.counters.steps += 1
            outputs += self._postprocess(scheduled, logits)
            seconds = self.clock() - step_start
            shape = StepShape.of((len(c.token_ids), c.past_len) for c in chunks)
            if seconds > 0:  # a clock that did not move (a test's) measured nothing
                self.cost_model.observe(shape, seconds)
            self.counters.record_step(
                StepRecord(seconds, batch.predicted_s, shape.prefill_tokens, shape.decode_seqs, batch.token_budget)
            )
            return outputs

    def _postprocess(self, scheduled: list[ScheduledChunk], logits: np.ndarray | DeviceSample) -> list[RequestOutput]:
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
            self.spec.propose([r for r, _ in to_sample] + [r for r, _, _ in to_verify], self.scheduler.running)
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
            lps = [logits.logprobs[row] for row in picked]
            result = SampleResult(logits.token_ids[picked], [None if lp is None else TokenLogprobs(*lp) for lp in lps])
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
                return self._finish(request, "stop", text, kept, lp)  # the stop token's text is not output
            delta, stopped = stream.add(token)
            text += delta
            if stopped:
                return self._finish(request, "stop", text, kept, lp)
            if request.num_output_tokens >= params.max_tokens:
                return self._finish(request, "length", text, kept, lp)
        return self._output(request, text, tokens, logprobs)

    def _finish(
        self,
        request: Request,
        reason: str,
        text: str,
        token_ids: list[int],
        lp: list[TokenLogprobs] | None,
        error: str | None = None,
    ) -> RequestOutput:
        stream = self.streams.pop(request.request_id)
        text += stream.finish()
        self.scheduler.remove(request)
        del self.requests[request.request_id]
        if self.spec is not None:
            self.spec.release(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        request.timing.finished = self.clock()
        self.counters.finished[reason] += 1
        out = self._output(request, text, token_ids, lp)
        out.finished, out.finish_reason, out.error = True, reason, error
        out.stats = RequestStats(**request.timing.summary(), num_preemptions=request.num_preemptions)
        return out

    def _output(
        self, request: Request, text: str, token_ids: list[int], lp: list[TokenLogprobs] | None
    ) -> RequestOutput:
        return RequestOutput(
            request.request_id, text, token_ids, logprobs=lp,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
        )  # fmt: skip

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = self.clock()
        expired = [
            r for r in self.requests.values()
            if r.params.deadline_s is not None and now - r.timing.arrival > r.params.deadline_s
        ]  # fmt: skip
        return [self._finish(r, "deadline", "", [], None) for r in expired]

    # ---- observability ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self._lock:
            c = self.counters
            return EngineStats(
                running=len(self.scheduler.running),
                waiting=self.scheduler.num_waiting,
                kv_usage=self.kv.pool.usage,
                kv_blocks=self.kv.pool.counts(),
                prefix_cache_queries=self.kv.prefix_queries,
                prefix_cache_hits=self.kv.prefix_hits,
                preemptions=self.scheduler.num_preemptions,
                prompt_tokens=c.prompt_tokens,
                generation_tokens=c.generation_tokens,
                steps=c.steps,
                finished=dict(c.finished),
                rejected_overloaded=c.rejected_overloaded,
                rejected_invalid=c.rejected_invalid,
                rejected_slo=c.rejected_slo,
                slo=dict(c.slo),
                step_time_s=c.step_time.snapshot(),
                prefill_tokens_per_step=c.prefill_per_step.snapshot(),
                step_token_budget=c.step_token_budget,
                itl_target_s=self.itl_target_s,
                step_cost=self.cost_model.coefficients,
                spec_decode=None if self.spec is None else self.spec.counters.snapshot(),
            )

    def take_step_records(self) -> list[StepRecord]:
        """The steps run since the last call (at most MAX_STEP_RECORDS), for metrics that observe each."""
        with self._lock:
            records = list(self.counters.recent_steps)
            self.counters.recent_steps.clear()
            return records

    def check_invariants(self) -> None:
        with self._lock:
            self.kv.check_invariants(list(self.requests.values()))

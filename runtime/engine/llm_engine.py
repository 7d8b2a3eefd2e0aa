"""The engine loop: schedule -> run the backend -> postprocess (sample, detokenize, finish: postprocess.py).

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
from executors import DeviceSample, DeviceSampling, create_backend
from executors.base import EngineBackend
from executors.sampling import SamplingParams, SamplingState
from runtime.engine.admission import Admission, Prompt
from runtime.engine.detokenizer import DetokenizedStream
from runtime.engine.disagg import Disagg
from runtime.engine.engine_args import EngineArgs
from runtime.engine.errors import InvalidRequest, Overloaded
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.outputs import RequestOutput
from runtime.engine.postprocess import Postprocessor
from runtime.engine.request import Request, RequestTiming
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.spec.decoding import create_spec_decoder
from runtime.engine.stats import EngineCounters, EngineStats, StepRecord
from runtime.engine.step_cost import OnlineStepCost, StepShape
from runtime.engine.step_inputs import build_chunks
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
        self.config = config = EngineConfig.load(engine_dir, verify=True)  # serving: files against the manifest
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
        self.spec = create_spec_decoder(args, config, max_num_seqs, clock)
        self.admission = Admission(self.tokenizer, config.model.vocab_size, config.max_seq_len, self.kv.capacity_tokens)
        self.eos_token_ids = frozenset(stop_token_ids(self.tokenizer, config))
        self.requests: dict[str, Request] = {}
        self.streams: dict[str, DetokenizedStream] = {}
        self.counters = EngineCounters()
        self.post = Postprocessor(self.requests, self.streams, self.scheduler, self.kv, self.spec, self.counters,
                                  self.eos_token_ids, clock, self.itl_target_s, self.tokenizer)  # fmt: skip
        self._lock = threading.RLock()
        self._arrivals = itertools.count()
        # disagg hook (runtime/engine/disagg.py): the worker's role, pinned and pulled KV blocks; inert for "both"
        self.disagg = Disagg.create(args.role, args.kv_pin_timeout_s, config, self.backend, self.kv, self.scheduler,
                                    max_num_seqs, self.requests, self._lock, clock)  # fmt: skip
        log.info(
            "KV cache: %d blocks x %d = %d tokens; max concurrency at max_seq_len %d: %.1f sequences "
            "(max_num_seqs %d)",
            self.kv.pool.num_blocks, config.block_size, self.kv.capacity_tokens, config.max_seq_len,
            self.kv.capacity_tokens / config.max_seq_len, max_num_seqs,
        )  # fmt: skip

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    prompt_ids: list[int] | None = None) -> str:  # fmt: skip
        """Validate and queue a request; raises InvalidRequest or Overloaded at once. `prompt_ids`: the
        prompt already tokenized (admission.tokenize), e.g. off an event loop by AsyncLLM."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        prompt_ids = self.tokenize(prompt) if prompt_ids is None else prompt_ids
        try:
            params = self.admission.fit(prompt, prompt_ids, params)
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
                # disagg hook: a request with a KV handle runs from its pulled blocks (or queues to recompute)
                if not self.disagg.adopt(request, stream):
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
            return None if request is None else self.post.finish(request, "abort")

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
                return outputs + [self.post.finish(r, "error", error=str(exc)) for r in failed]
        with self._lock:
            self.counters.steps += 1
            # disagg hook: prefill-only requests with their first token end here, their KV pinned for a decode worker
            stepped = self.disagg.hand_off(self.post.run(scheduled, logits), self.post.finish)
            seconds = target_s = self.clock() - step_start
            if self.spec is not None:  # the drafting for the next step is the proposer's time, not the target's
                decodes = len(scheduled) if all(s.num_tokens - len(s.drafts) == 1 for s in scheduled) else None
                target_s = self.spec.observe_step(seconds, sum(len(o.token_ids) for o in stepped), decodes)
            outputs += stepped
            shape = StepShape.of((len(c.token_ids), c.past_len) for c in chunks)
            if target_s > 0:  # a clock that did not move (a test's) measured nothing
                self.cost_model.observe(shape, target_s)
            self.counters.record_step(
                StepRecord(seconds, batch.predicted_s, shape.prefill_tokens, shape.decode_seqs, batch.token_budget)
            )
            return outputs

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = self.clock()
        expired = [
            r for r in self.requests.values()
            if r.params.deadline_s is not None and now - r.timing.arrival > r.params.deadline_s
        ]  # fmt: skip
        return [self.post.finish(r, "deadline") for r in expired]

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (chat messages through the chat template), or InvalidRequest naming the problem.
        Touches no engine state: any thread may call it."""
        try:
            return self.admission.tokenize(prompt)
        except InvalidRequest:
            self.counters.rejected_invalid += 1
            raise

    @property
    def context_tokens(self) -> int:
        """The most tokens one sequence can hold: the engine's max_seq_len, or the whole KV cache if smaller."""
        return min(self.config.max_seq_len, self.kv.capacity_tokens)

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
                kv_max_concurrency=self.kv.capacity_tokens / self.config.max_seq_len,
            )

    def take_step_records(self) -> list[StepRecord]:
        """The steps run since the last call (at most MAX_STEP_RECORDS), for metrics that observe each."""
        with self._lock:
            records = list(self.counters.recent_steps)
            self.counters.recent_steps.clear()
            return records

    def check_invariants(self) -> None:
        with self._lock:
            # disagg hook: pinned and staged blocks are references too
            self.kv.check_invariants(list(self.requests.values()), held=self.disagg.held_blocks())

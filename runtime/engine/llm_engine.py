"""The engine loop: schedule -> run the backend -> update (sample, append, finish: step_update.py).

`LLMEngine` is synchronous and driven by `step()`, which returns text deltas: the core's `step_tokens()`
(token ids) through the output processor (detokenization and stop strings, output_processor.py), which
AsyncLLM runs on a thread of its own instead, off the step path. `add_request` and `abort` may be called
from other threads (the async engine does), so engine state is guarded by one lock that is released while
the backend runs. The scheduler never touches tensors and the backend never makes scheduling decisions.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engine_format import EngineConfig
from executors import DeviceSample, DeviceSampling, prepare_backend
from executors.base import EngineBackend, SequenceChunk
from executors.device_sampling import PLACEHOLDER, OverlappedSampling
from executors.lora import AdapterError, LoraAdapter
from executors.sampling import SamplingParams, SamplingState
from runtime.engine.admission import Admission, Prompt
from runtime.engine.disagg import Disagg
from runtime.engine.engine_args import EngineArgs
from runtime.engine.errors import InvalidRequest, Overloaded
from runtime.engine.grammar_cache import GrammarCache
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.kv_tiers import create_tiers
from runtime.engine.lora_manager import create_lora_manager
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.outputs import RequestOutput, TokenOutput
from runtime.engine.request import Request, RequestTiming
from runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from runtime.engine.spec.decoding import create_spec_decoder
from runtime.engine.stats import EngineCounters, EngineStats, StepRecord
from runtime.engine.step_cost import OnlineStepCost, StepShape
from runtime.engine.step_inputs import InFlight, StepChunks, build_chunks
from runtime.engine.step_update import StepUpdate
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
        # The backend's modules before the tokenizer: the tokenizer loads transformers and with it torch's
        # libgomp, which must come after the attention kernel sets its OpenMP wait policy. Then the tokenizer
        # loads on a thread while the backend builds (mostly native work, which releases the GIL).
        if backend is None:
            build = prepare_backend(
                config, args.num_kv_blocks, args.threads, args.backend, args.max_num_batched_tokens, args.dtype
            )
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as loader:
            tokenizer = loader.submit(load_tokenizer, engine_dir)
            self.backend = backend if backend is not None else build()
            self._warm_up(args)
        self.tokenizer = tokenizer.result()
        # The backend's own sampler, and its overlapped launches, if it has them (checked once: a runtime Protocol
        # check is slow).
        self.device_sampling: DeviceSampling | None = self.backend if isinstance(self.backend, DeviceSampling) else None
        # A prefill worker hands requests off at their first token, which an overlapped step has not resolved yet.
        can_overlap = (
            args.overlap_scheduling and isinstance(self.backend, OverlappedSampling) and args.role != "prefill"
        )
        self.overlap: OverlappedSampling | None = self.backend if can_overlap else None  # type: ignore[assignment]
        self._in_flight: InFlight | None = None
        self.kv = KVCacheManager(self.backend.num_blocks, config.block_size, args.enable_prefix_caching)
        if args.enable_prefix_caching:  # the tiers keep what the prefix cache indexes
            self.kv.tiers = create_tiers(
                config, self.backend, self.kv.pool, args.kv_host_cache_gb, args.kv_disk_cache, args.kv_disk_cache_gb
            )
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
        self.loras = create_lora_manager(args, self.backend, config) if args.lora_enabled else None
        self.scheduler.loras = self.loras
        self.spec = create_spec_decoder(args, config, max_num_seqs, clock)
        self.admission = Admission(self.tokenizer, config.model.vocab_size, config.max_seq_len, self.kv.capacity_tokens)
        self.eos_token_ids = frozenset(stop_token_ids(self.tokenizer, config))
        # Structured output (hook): compiles grammars off the loop, once each; gives each request its matcher.
        self.grammars = GrammarCache(self.tokenizer, config.model.vocab_size, sorted(self.eos_token_ids),
                                     args.grammar_compile_timeout_s)  # fmt: skip
        self.counters = EngineCounters()
        self._lock = threading.RLock()
        self._arrivals = itertools.count()
        # disagg hook (runtime/engine/disagg.py): the worker's role, pinned and pulled KV blocks; inert for "both"
        self.disagg = Disagg.create(args.role, args.kv_pin_timeout_s, config, self.backend, self.kv, self.scheduler,
                                    self._lock, clock)  # fmt: skip
        self.update = StepUpdate(
            self.scheduler, self.spec, self.counters, clock, self.itl_target_s, self.disagg.kv_handle
        )
        self.outputs = OutputProcessor(self.tokenizer, self.finish_by_text)
        log.info(
            "KV cache: %d blocks x %d = %d tokens; max concurrency at max_seq_len %d: %.1f sequences "
            "(max_num_seqs %d)",
            self.kv.pool.num_blocks, config.block_size, self.kv.capacity_tokens, config.max_seq_len,
            self.kv.capacity_tokens / config.max_seq_len, max_num_seqs,
        )  # fmt: skip

    def _warm_up(self, args: EngineArgs) -> None:
        """GPU backends compile and capture before serving, so no request waits for a kernel compile."""
        warm_up = getattr(self.backend, "warm_up", None)
        if warm_up is None:
            return
        seconds = warm_up(args.max_num_seqs or self.config.max_batch_size, args.max_num_batched_tokens)
        if seconds:
            log.info("backend warmed up in %.1f s: no request waits for a kernel compile or graph capture", seconds)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_ids: list[int] | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> str:
        """Validate and queue a request; raises InvalidRequest or Overloaded at once. `prompt_ids`: the
        prompt already tokenized (admission.tokenize), e.g. off an event loop by AsyncLLM. `resume_token_ids`:
        the answer so far of a stream cut elsewhere (see _resume)."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        prompt_ids = self.tokenize(prompt) if prompt_ids is None else prompt_ids
        stop_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)
        try:
            params = self.admission.fit(prompt, prompt_ids, params)
            self.admission.check_resume(resume_token_ids, params, stop_ids)
            grammar = self.grammars.matcher(params)  # structured output (hook): the request's matcher, or None
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
                sampling=SamplingState(params, prompt_ids, self.config.model.vocab_size, grammar),
                arrival_order=next(self._arrivals),
                timing=RequestTiming(arrival=self.clock()),
                stop_token_ids=stop_ids,
            )
            self._register_lora(request)
            self.outputs.add(request_id, prompt_ids, params)  # before the core can produce anything for it
            self._resume(request, resume_token_ids)
            request.prefill_only = self.disagg.take_export(request_id)  # disagg hook: it ends with its first token
            try:
                # disagg hook: a request with a KV handle runs from its pulled blocks (or queues to recompute)
                if not self.disagg.adopt(request, self._resume):
                    self.scheduler.add(request)  # raises Overloaded: queue full, or its TTFT target unreachable
            except (Overloaded, InvalidRequest) as exc:  # queue full, its TTFT target unreachable, a handle unusable
                self.outputs.forget(request_id)
                if self.loras is not None:
                    self.loras.unregister_request(request)
                if isinstance(exc, InvalidRequest) and exc.field == "kv_handle":
                    self.counters.rejected_invalid += 1
                elif isinstance(exc, InvalidRequest) or exc.reason == "slo":  # unreachable TTFT target
                    self.counters.rejected_slo += 1
                else:
                    self.counters.rejected_overloaded += 1
                raise
        return request_id

    def _register_lora(self, request: Request) -> None:
        """The request's adapter resolved (InvalidRequest naming `lora` if this engine does not serve it)."""
        if self.loras is not None:
            try:
                self.loras.register_request(request)
            except InvalidRequest:
                self.counters.rejected_invalid += 1
                raise
        elif request.params.lora is not None:
            self.counters.rejected_invalid += 1
            raise InvalidRequest("lora", f"adapter {request.params.lora!r}: this server serves no LoRA adapters")

    # ---- LoRA adapters (runtime/engine/lora_manager.py) ---------------------------------------

    def add_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """Serve another adapter (AdapterError, a ValueError naming the problem, if it cannot run here)."""
        if self.loras is None:
            raise AdapterError(name, "enable_lora", "this engine was started without LoRA (EngineArgs.enable_lora)")
        start = time.perf_counter()
        adapter = self.loras.read(name, path)  # files read and checked while steps go on
        with self._lock:
            self.loras.add(adapter, time.perf_counter() - start)
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter: True if it left now, False once its requests finish (InvalidRequest if it is
        not served)."""
        if self.loras is None:
            raise InvalidRequest("lora", f"adapter {name!r} is not loaded (this engine serves no LoRA adapters)")
        with self._lock:
            return self.loras.remove(name)

    def list_loras(self) -> dict[str, str]:
        """The adapters served: name -> directory (empty without LoRA)."""
        if self.loras is None:
            return {}
        with self._lock:
            return {name: str(path) for name, path in self.loras.paths.items() if name not in self.loras.removing}

    def _resume(self, request: Request, token_ids: Sequence[int]) -> None:
        """A stream resumed after its replica failed: the answer so far becomes this request's output, as if it
        had generated it (penalty counts, the grammar's matcher, a seed's draws: the sampler draws once per
        random token) and its text had gone out (the detokenizer takes it as context). The scheduler then
        prefills prompt and answer together, as after a preemption, and generation goes on."""
        for token in token_ids:
            request.append_output_token(token)
            request.sampling.append(token)
            if not request.params.greedy:
                request.sampling.rng.random()
            self.outputs.replay(request.request_id, token)

    @property
    def requests(self) -> dict[str, Request]:
        """The live requests, waiting or running, by id (the scheduler's)."""
        return self.scheduler.requests

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its KV blocks; its final output, or None if it is not live."""
        out = self.abort_tokens(request_id)
        return None if out is None else self.outputs.process([out])[0]

    def abort_tokens(self, request_id: str, reason: str = "abort") -> TokenOutput | None:
        """`abort` for the core: the final TokenOutput (not yet through the output processor)."""
        with self._lock:
            request = self.requests.get(request_id)
            return None if request is None else self.update.finish(request, reason)

    def finish_by_text(self, request_id: str) -> TokenOutput | None:
        """The output processor found a stop string: finish the request in the core (already done: None)."""
        return self.abort_tokens(request_id, reason="stop")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step's text deltas (the core's step through the output processor, inline)."""
        return self.outputs.process(self.step_tokens())

    def step_tokens(self) -> list[TokenOutput]:
        """One step of the core: schedule, run the backend, update; each request's new tokens. With a backend
        that can (OverlappedSampling) and requests that allow it, the step is launched and the previous
        launch's tokens are returned instead: the device computes while the host schedules the next step."""
        overlap = self.overlap is not None and self.spec is None and self.scheduler.num_host_sampled == 0
        if self._in_flight is not None and (not overlap or not self.requests):
            with self._lock:  # the launched tokens first: this step's host sampling needs them
                return self._resolve()
        step_start = self.clock()
        with self._lock:
            outputs = self._expire_deadlines()
            batch = self.scheduler.schedule()
            if batch.is_empty:
                outputs += self._resolve() if self._in_flight is not None else []
                loading = self.kv.tiers is not None and self.kv.tiers.loading
            else:
                step, rows = self._start(batch)
        if batch.is_empty:
            if loading:  # nothing runs until a tier's blocks are read back: wait for them, not spin
                assert self.kv.tiers is not None
                self.kv.tiers.wait(0.01)
            return outputs
        if overlap:
            return outputs + self._launch(step, rows, batch, step_start)
        try:
            # lock released: add/abort proceed
            if self.device_sampling is not None and not step.drafting and not step.scoring:
                logits: np.ndarray | DeviceSample = self.device_sampling.step_sample(step.chunks, rows)
            else:
                logits = self.backend.step(step.chunks)
        except Exception as exc:  # fail this step's requests, keep serving the others
            return outputs + self._fail(step, exc)
        with self._lock:
            self.counters.steps += 1
            stepped = self.update.run(step, logits)
            seconds = target_s = self.clock() - step_start
            if self.spec is not None:  # the drafting for the next step is the proposer's time, not the target's
                # a pure decode step: each chunk one token plus its drafts
                pure = not step.scoring and all(len(c.token_ids) == c.num_logits for c in step.chunks)
                decodes = len(step.chunks) if pure else None
                target_s = self.spec.observe_step(seconds, sum(len(o.token_ids) for o in stepped), decodes)
            self._observe(step.chunks, batch, seconds, target_s)
            return outputs + stepped

    def _start(self, batch: ScheduledBatch) -> tuple[StepChunks, list[SamplingState | None]]:
        """The step's chunks, and its rows the backend samples on its device if it can (drafts are verified on
        the host, from logits of every draft position)."""
        now = self.clock()
        for request in batch.admitted:  # (running ones were scheduled before)
            if request in batch.num_tokens:  # not preempted again by a later allocation this step
                request.timing.first_scheduled = request.timing.first_scheduled or now
        step = build_chunks(batch.num_tokens)
        return step, step.sampling_rows() if self.device_sampling else []

    def _launch(self, step: StepChunks, rows: list[SamplingState | None], batch: ScheduledBatch,
                start: float) -> list[TokenOutput]:  # fmt: skip
        """Launch this step, then resolve the previous launch (the device computes this one meanwhile). Its
        sampled rows advance at once, each with a placeholder token the next step's decode takes on the device."""
        assert self.overlap is not None
        previous = self._in_flight
        sources = np.array([r.pending_row if r.all_token_ids[c.past_len] == PLACEHOLDER else -1
                            for r, c in zip(step.requests, step.chunks, strict=True)], np.int64)  # fmt: skip
        try:
            pending = self.overlap.launch(step.chunks, rows, sources, None if previous is None else previous.pending)
        except Exception as exc:
            with self._lock:
                outputs = self._resolve() if previous is not None else []
            return outputs + self._fail(step, exc)
        with self._lock:
            self.counters.steps += 1
            self._in_flight = InFlight(self.update.launched(step), pending, step, batch, start)
            return [] if previous is None else self._resolve(previous)

    def _resolve(self, launched: InFlight | None = None) -> list[TokenOutput]:
        """A launched step's tokens, waited for (default: the one in flight, which is then done)."""
        if launched is None:
            launched, self._in_flight = self._in_flight, None
        assert launched is not None
        outputs = self.update.resolve(launched.placed, launched.pending.result())
        seconds = self.clock() - launched.start  # the step's cadence: launch to its tokens on the host
        self._observe(launched.step.chunks, launched.batch, seconds, seconds)
        return outputs

    def _fail(self, step: StepChunks, exc: Exception) -> list[TokenOutput]:
        """The backend failed this step: finish its requests with the error, keep serving the others."""
        log.exception("backend step failed; finishing its %d requests with an error", len(step.requests))
        with self._lock:
            failed = [r for r in step.requests if not r.is_finished]
            return [self.update.finish(r, "error", error=str(exc)) for r in failed]

    def _observe(self, chunks: list[SequenceChunk], batch: ScheduledBatch, seconds: float, target_s: float) -> None:
        shape = StepShape.of((len(c.token_ids), c.past_len) for c in chunks) if batch.preempted else batch.shape
        if target_s > 0:  # a clock that did not move (a test's) measured nothing
            self.cost_model.observe(shape, target_s)
        self.counters.record_step(
            StepRecord(seconds, batch.predicted_s, shape.prefill_tokens, shape.decode_seqs, batch.token_budget)
        )

    def _expire_deadlines(self) -> list[TokenOutput]:
        if not self.scheduler.num_deadlines:  # the common case: no scan of every request
            return []
        now = self.clock()
        expired = [
            r for r in self.requests.values()
            if r.params.deadline_s is not None and now - r.timing.arrival > r.params.deadline_s
        ]  # fmt: skip
        return [self.update.finish(r, "deadline") for r in expired]

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
                grammar=self.grammars.stats(),  # structured output (hook)
                kv_tiers=None if self.kv.tiers is None else self.kv.tiers.stats(),
                lora=None if self.loras is None else self.loras.stats(),
            )

    def take_step_records(self) -> list[StepRecord]:
        """The steps run since the last call (at most MAX_STEP_RECORDS), for metrics that observe each."""
        with self._lock:
            records = list(self.counters.recent_steps)
            self.counters.recent_steps.clear()
            return records

    def close(self) -> None:
        """After the last step: the KV tiers write what the disk tier lacks (a restart finds it), the transfer
        agent deregisters the pool."""
        with self._lock:
            self.kv.close_tiers()
        self.disagg.close()

    def check_invariants(self) -> None:
        with self._lock:
            # disagg hook: pinned and staged blocks are references too
            self.kv.check_invariants(list(self.requests.values()), held=self.disagg.held_blocks())

"""Async engine: the engine core steps apart from the callers, who stream deltas.

    engine = AsyncLLM(engine_dir)
    async for delta in engine.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.text, end="")

Leaving the `async for` early (break, cancellation, client disconnect) aborts the request
and frees its KV blocks at once. Admission errors (InvalidRequest, Overloaded) are raised
by `generate` before the first delta. A text or chat prompt is tokenized off the event loop (a
long prompt must not stall the other requests' streams). A delta carries up to the stream interval's tokens
(EngineArgs.stream_interval, or the request's own if longer); the first token and the final
delta are passed on at once.

Where the core runs (EngineArgs.engine_process):
- in a process of its own, the default (runtime/engine/core_process.py, vLLM's EngineCoreProc):
  its steps never wait for this process's GIL (the text, the event loop, the Triton model). This process keeps
  the tokenizer, the text and the streams; one thread receives the core's steps and turns them into text
  (detokenization, stop strings), and a stop string found here aborts the request in the core, a step late
  at most. A stream whose caller falls behind takes what came meanwhile as one delta. The disaggregation
  doors' calls cross to the core too; a KV read runs there (runtime/engine/core_pulls.py).
- on a thread of this process (EngineArgs(engine_process=False), or a `backend` object given): the
  engine thread runs the core's steps and the output thread turns them into text, so the next step starts
  without waiting for the text of the last one, but both hold this process's GIL in turn. Every output of a
  request, an abort's final one included, goes through the output thread's one queue, in order.

Either way the engine knows each request by an id of its own (runtime/request_ids.py): a caller may reuse its
id once its stream ended, and the request before it is still told apart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from engine_format import EngineConfig
from engine_format.requests import OPENAI_MAX_STRING
from executors.base import EngineBackend
from executors.sampling import SamplingParams
from runtime.delta_streams import DeltaStream, send_step
from runtime.engine.admission import Admission, Prompt
from runtime.engine.core_client import BackendFactory, CoreProcessDisagg, EngineCoreClient, EngineCoreDied
from runtime.engine.errors import InvalidRequest
from runtime.engine.llm_engine import EngineArgs, LLMEngine
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.outputs import RequestOutput, TokenOutput
from runtime.engine.stats import EngineProgress, EngineStats, StepRecord
from runtime.engine.tokenizer import load_tokenizer
from runtime.request_ids import DisaggDoor, RequestIds, caller_id

log = logging.getLogger(__name__)
# A shut down core's time past its drain to abort the rest, write its KV tiers and close, before it is killed.
CORE_CLOSE_GRACE_S = 30.0


class AsyncLLM:
    def __init__(
        self,
        engine_dir: str | Path,
        args: EngineArgs | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
        backend: EngineBackend | None = None,
        backend_factory: BackendFactory | None = None,
    ):
        """`backend`: run this one instead of the engine's (benchmarks: a no-work or simulated device), with the
        core in this process; `backend_factory` builds one in the core's own process instead."""
        args = args or EngineArgs()
        self.on_finished = on_finished  # e.g. metrics: called on the output thread
        self.stream_interval = args.stream_interval
        self._ids = RequestIds()  # the engine knows each request by an id of its own (runtime/request_ids.py)
        self._live: dict[str, str] = {}  # caller's id -> its request's engine id, while its stream is open
        self._streams: dict[str, DeltaStream] = {}  # by engine id
        self._outputs: queue.SimpleQueue[list[TokenOutput] | None] = queue.SimpleQueue()  # None: stop
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._core: EngineCoreClient | None = None
        self._rejected_here = 0  # core in its own process: prompts refused here (it never saw them)
        if backend_factory is not None and not args.engine_process:
            raise ValueError("backend_factory builds the backend in the engine core's process, which is off")
        if args.engine_process and backend is None:  # (a backend given: this process's, as asked)
            self._start_core_process(engine_dir, args, backend_factory)
            return
        # The engine is built on the thread that steps it: OpenMP (the CPU kernel, torch) keeps a pool of
        # worker threads per thread that starts parallel work, and once pools outnumber the cores, libgomp
        # stops letting workers spin: cpu-bf16 steps built on one thread and run on another took 49.5
        # instead of 27.6 ms (8 decodes), its elementwise ops 70 instead of 12 us.
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine_dir, args, backend, built), name="trtserve-engine", daemon=True
        )
        self._thread.start()
        self._engine = engine = built.result()  # a failed build raises here, on the caller's thread
        self.admission, self.outputs = engine.admission, engine.outputs
        self.outputs.on_finished = self._observe_finished
        self._door = DisaggDoor(self._ids, engine.disagg)
        self._output_thread = threading.Thread(target=self._process_outputs, name="trtserve-outputs", daemon=True)
        self._output_thread.start()

    def _start_core_process(
        self, engine_dir: str | Path, args: EngineArgs, backend_factory: BackendFactory | None
    ) -> None:
        """The core in its own process; the tokenizer, admission's checks and the text here."""
        self._core = core = EngineCoreClient(engine_dir, args, backend_factory)
        try:
            config = EngineConfig.load(engine_dir)
            tokenizer = load_tokenizer(engine_dir)  # while the core builds its engine
            self._core_info = info = core.wait_ready()
        except BaseException:
            core.close(timeout_s=0)
            raise
        self.admission = Admission(tokenizer, config.model.vocab_size, config.max_seq_len, info.capacity_tokens)
        self.outputs = OutputProcessor(tokenizer, self._stop_in_core, self._observe_finished)
        self._disagg = CoreProcessDisagg(core, args.role)
        self._door = DisaggDoor(self._ids, self._disagg)
        # One thread: the core's steps in, text out (the core's own threads step it).
        self._thread = self._output_thread = threading.Thread(
            target=self._receive, name="trtserve-outputs", daemon=True
        )
        self._thread.start()

    @property
    def engine(self) -> LLMEngine:
        """The engine, when it runs in this process (tests and benchmarks read its parts)."""
        if self._engine is None:
            raise RuntimeError("the engine core runs in a process of its own (EngineArgs.engine_process)")
        return self._engine

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """The request's deltas; `resume_token_ids`: the answer so far of a stream cut elsewhere (the engine's
        add_request)."""
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        if self._stopping:
            raise RuntimeError("engine is shutting down")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._live:  # checked before touching the live request's queue
            raise InvalidRequest("request_id", f"{request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        prompt_ids = await self.tokenize(prompt)
        if self._core is None:
            await self.engine.grammars.prepare(params)  # structured output (hook): compiled off this loop
        if request_id in self._live:  # taken while this one was tokenized
            raise InvalidRequest("request_id", f"{request_id!r} is already in use")
        interval = max(self.stream_interval, (params and params.stream_interval) or 1)
        engine_id = self._live[request_id] = self._ids.take(request_id)
        # A core in its own process runs ahead of this loop: a stream behind takes what came meanwhile as one delta.
        stream = self._streams[engine_id] = DeltaStream(loop, interval, coalesce=self._core is not None)
        try:
            if self._core is not None:
                await self._add_in_core(prompt, params, engine_id, prompt_ids, resume_token_ids)
            else:
                self.engine.add_request(prompt, params, engine_id, prompt_ids, resume_token_ids)
                if not self._thread.is_alive():  # the loop ended (shutdown or error) meanwhile
                    self.engine.abort(engine_id)
                    raise RuntimeError(f"engine is not running: {self._error!r}")
                self._wake.set()
        except BaseException:
            self._streams.pop(engine_id, None)
            self._live.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                delta = await stream.get()
                finished, delta.request_id = delta.finished, request_id
                yield delta
        finally:
            self._streams.pop(engine_id, None)
            self._live.pop(request_id, None)
            if not finished:
                self._abort(engine_id)

    async def _add_in_core(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        engine_id: str,
        prompt_ids: list[int],
        resume_token_ids: Sequence[int],
    ) -> None:
        """add_request across the process boundary: the text's state here first (the core's first token may
        arrive before its answer), the core's admission errors raised here."""
        assert self._core is not None
        self.outputs.add(engine_id, prompt_ids, params or SamplingParams())
        # The answer so far went out before (a resumed stream's, a KV handle's first token): the detokenizer's
        # context, in the order the core takes them (add_request: resumed, then adopted).
        for token in (*resume_token_ids, *self._disagg.first_tokens(engine_id)):
            self.outputs.replay(engine_id, token)
        try:
            added = self._core.add(engine_id, prompt, prompt_ids, params, resume_token_ids)
            await asyncio.shield(asyncio.wrap_future(added))
        except asyncio.CancelledError:  # the caller left while the core was adding it: abort it once added

            def abort_added(done: concurrent.futures.Future[None]) -> None:
                if done.exception() is None:
                    self._abort(engine_id)

            added.add_done_callback(abort_added)
            raise
        except BaseException as exc:
            self.outputs.forget(engine_id)
            if isinstance(exc, EngineCoreDied):
                raise RuntimeError(f"engine is not running: {exc}") from None
            raise

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as the engine counts them (chat messages through the chat template), off the
        event loop; InvalidRequest naming the problem."""
        return await asyncio.get_running_loop().run_in_executor(None, self._tokenize, prompt)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if self._core is None:
            return self.engine.tokenize(prompt)  # (counts a refusal in the engine's stats)
        try:
            return self.admission.tokenize(prompt)
        except InvalidRequest:
            self._rejected_here += 1
            raise

    async def detokenize(self, token_ids: list[int]) -> str:
        """Token ids' text, special tokens kept, off the event loop; InvalidRequest naming an id outside the
        vocabulary."""
        return await asyncio.get_running_loop().run_in_executor(None, self.admission.detokenize, token_ids)

    async def add_lora(self, name: str, path: str) -> None:
        """Serve another LoRA adapter (read and checked off the event loop); AdapterError naming the problem."""
        if self._core is not None:
            await asyncio.wrap_future(self._core.call("add_lora", name, path))
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.add_lora, name, path)

    async def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter: True if it left now, False once its requests finish."""
        if self._core is not None:
            return await asyncio.wrap_future(self._core.call("remove_lora", name))
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.remove_lora, name)

    def list_loras(self) -> dict[str, str]:
        """The adapters served: name -> directory (empty without LoRA)."""
        return self._core.call("list_loras").result() if self._core is not None else self.engine.list_loras()

    def abort(self, request_id: str) -> bool:
        """Abort the caller's live request `request_id` now (frees its KV blocks); its stream ends with 'abort'."""
        engine_id = self._live.get(request_id)
        return engine_id is not None and self._abort(engine_id)

    def _abort(self, engine_id: str) -> bool:
        if self._core is not None:  # the core answers with the final output, in order with its steps
            with contextlib.suppress(EngineCoreDied):
                self._core.abort(engine_id)
            return True
        out = self.engine.abort_tokens(engine_id)
        if out is not None:
            self._outputs.put([out])
        return out is not None

    def _stop_in_core(self, engine_id: str) -> None:
        """The output processor found a stop string: finish the request in the core (its final output, which
        this process has already sent, brings only its stats)."""
        assert self._core is not None
        with contextlib.suppress(EngineCoreDied):
            self._core.abort(engine_id, "stop")

    @property
    def context_tokens(self) -> int:
        """The most tokens one sequence can hold (prompt and output)."""
        return self._core_info.context_tokens if self._core is not None else self.engine.context_tokens

    def max_prompt_chars(self, cap: int = OPENAI_MAX_STRING) -> int:
        """The most characters a prompt that could fit the context has (longer ones are refused untokenized)."""
        return self.admission.max_prompt_chars(self.context_tokens, cap)

    def stats(self) -> EngineStats:
        if self._core is None:
            return self.engine.stats()
        stats = self._core.call("stats").result()  # with the prompts refused here, untokenizable
        return dataclasses.replace(stats, rejected_invalid=stats.rejected_invalid + self._rejected_here)

    def take_step_records(self) -> list[StepRecord]:
        """The engine steps run since the last call (for metrics that observe each)."""
        if self._core is not None:
            return self._core.call("take_step_records").result()
        return self.engine.take_step_records()

    def take_grammar_compile_seconds(self) -> list[float]:
        """Structured output: the grammar compiles finished since the last call, in seconds each."""
        if self._core is not None:
            return self._core.call("grammars.take_compile_seconds").result()
        return self.engine.grammars.take_compile_seconds()

    @property
    def disagg(self) -> DisaggDoor:
        """Prefill/decode disaggregation: this worker's role and the doors' calls (export, expect, pull, forget),
        under the caller's request ids (`forget`: the engine id that export or expect gave)."""
        return self._door

    def progress(self) -> EngineProgress:
        """Steps run, requests unfinished, and why the engine loop stopped (None while it runs); cheap,
        without the engine's lock (plain reads), for a supervisor's heartbeat."""
        problem = None if self._thread.is_alive() else f"engine loop stopped: {self._error!r}"
        if self._core is not None:  # as of the last step received
            return EngineProgress(self._core.steps, self._core.unfinished, problem)
        return EngineProgress(self.engine.counters.steps, len(self.engine.requests), problem)

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting requests, let running ones finish (up to the timeout), stop the loop."""
        self._stopping = True
        if self._core is not None:
            with contextlib.suppress(EngineCoreDied):
                self._core.shutdown(drain_timeout_s)
            self._thread.join(drain_timeout_s + CORE_CLOSE_GRACE_S)  # until the core has closed (or died)
            if self._thread.is_alive():  # a core that does not answer (stopped, stuck in a step)
                log.warning("engine core process did not close: killed")
                self._core.process.kill()
                self._thread.join()
            self._core.close()
            return
        self._wake.set()
        self._thread.join(drain_timeout_s)
        for engine_id in list(self.engine.requests):  # past the timeout: abort the rest
            self._abort(engine_id)
        self._thread.join()
        self._outputs.put(None)
        self._output_thread.join()
        self.engine.close()  # the KV tiers write to disk, the transfer agent deregisters the KV pool

    def _run(
        self,
        engine_dir: str | Path,
        args: EngineArgs | None,
        backend: EngineBackend | None,
        built: concurrent.futures.Future[LLMEngine],
    ) -> None:
        try:
            engine = LLMEngine(engine_dir, args, backend=backend)
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(engine)
        try:
            while not (self._stopping and not engine.has_unfinished_requests()):
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                outputs = engine.step_tokens()
                if outputs:
                    self._outputs.put(outputs)
        except BaseException as exc:  # surface to every waiting caller instead of hanging them
            log.exception("engine loop failed")
            self._fail_streams(exc)

    def _receive(self) -> None:
        """Engine core process mode's one thread: each step's outputs from the core -> text deltas -> streams."""
        assert self._core is not None
        try:
            while (outputs := self._core.receive()) is not None:
                self._to_text(outputs)
        except EngineCoreDied as exc:
            self._fail_streams(exc)

    def _process_outputs(self) -> None:
        """The output thread: token outputs -> text deltas -> each stream's queue, in order."""
        while (outputs := self._outputs.get()) is not None:
            self._to_text(outputs)

    def _to_text(self, outputs: list[TokenOutput]) -> None:
        try:
            deltas = self.outputs.process(outputs)
        except Exception as exc:  # a bug in text handling fails these requests, not the engine
            log.exception("output processing failed")
            for failed in outputs:
                self.outputs.forget(failed.request_id)
                self._abort_core(failed.request_id)
                self._deliver_error(failed.request_id, f"output processing failed: {exc!r}")
            return
        due = []
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None and (ready := stream.due(delta)) is not None:
                due.append((stream, ready))
        if self._core is not None:  # one wake-up of the loop a step (in one process, its burst would hold the
            send_step(due)  # GIL while the engine thread waits for it to launch the next step)
        else:
            for stream, ready in due:
                stream.send(ready)

    def _observe_finished(self, final: RequestOutput) -> None:
        """The output processor's: each finished request once, with the core's stats, under the caller's id."""
        if self.on_finished is not None:
            try:  # (a copy: `final` is also the stream's last delta, found by its engine id)
                self.on_finished(dataclasses.replace(final, request_id=caller_id(final.request_id)))
            except Exception:  # an observer must not take the output thread down
                log.exception("on_finished callback failed")

    def _abort_core(self, request_id: str) -> None:
        """Finish a request in the core without a final output (its stream was told why already)."""
        if self._core is not None:
            with contextlib.suppress(EngineCoreDied):
                self._core.abort(request_id)
        else:
            self.engine.abort_tokens(request_id)

    def _fail_streams(self, exc: BaseException) -> None:
        self._error = exc
        for request_id in list(self._streams):
            self._deliver_error(request_id, f"engine loop died: {exc!r}")

    def _deliver_error(self, request_id: str, message: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.send(RuntimeError(message))

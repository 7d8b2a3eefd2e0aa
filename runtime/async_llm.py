"""Async engine: the engine loop runs on its own thread; callers stream deltas.

    engine = AsyncLLM(engine_dir)
    async for delta in engine.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.text, end="")

Leaving the `async for` early (break, cancellation, client disconnect) aborts the request
and frees its KV blocks at once. Admission errors (InvalidRequest, Overloaded) are raised
by `generate` before the first delta. A text or chat prompt is tokenized off the event loop (a
long prompt must not stall the other requests' streams). A delta carries up to the stream interval's tokens
(EngineArgs.stream_interval, or the request's own if longer); the first token and the final
delta are passed on at once.

Two threads: the engine thread runs the core's steps (token ids), and the output thread turns them into
text (the engine's output processor: detokenization, stop strings) and hands each stream its deltas, so
the next step starts without waiting for the text of the last one. Every output of a request, an abort's
final one included, goes through the output thread's one queue, in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_format.requests import OPENAI_MAX_STRING
from executors.base import EngineBackend
from executors.sampling import SamplingParams
from runtime.engine.admission import Prompt
from runtime.engine.disagg import Disagg
from runtime.engine.errors import InvalidRequest
from runtime.engine.llm_engine import EngineArgs, LLMEngine
from runtime.engine.outputs import RequestOutput, TokenOutput
from runtime.engine.stats import EngineProgress, EngineStats, StepRecord

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """A request's way to its caller: its loop and queue, and the delta held back until the stream
    interval's tokens are ready."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    interval: int
    held: RequestOutput | None = None
    started: bool = False  # the first delta went out

    def due(self, out: RequestOutput) -> RequestOutput | None:
        """`out` merged after what is held, if it is due now (the first, the final, or a full
        interval's tokens); else None, and it is held."""
        if self.held is not None:
            out, self.held = self.held.merge(out), None
        if out.finished or not self.started or len(out.token_ids) >= self.interval:
            self.started = True
            return out
        self.held = out
        return None


class AsyncLLM:
    def __init__(
        self,
        engine_dir: str | Path,
        args: EngineArgs | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
        backend: EngineBackend | None = None,
    ):
        """`backend`: run this one instead of the engine's (benchmarks: a no-work or simulated device)."""
        self.on_finished = on_finished  # e.g. metrics: called on the output thread
        self.stream_interval = (args or EngineArgs()).stream_interval
        self._streams: dict[str, _Stream] = {}
        self._outputs: queue.SimpleQueue[list[TokenOutput] | None] = queue.SimpleQueue()  # None: stop
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        # The engine is built on the thread that steps it: OpenMP (the CPU kernel, torch) keeps a pool of
        # worker threads per thread that starts parallel work, and once pools outnumber the cores, libgomp
        # stops letting workers spin: cpu-bf16 steps built on one thread and run on another took 49.5
        # instead of 27.6 ms (8 decodes), its elementwise ops 70 instead of 12 us.
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine_dir, args, backend, built), name="trtserve-engine", daemon=True
        )
        self._thread.start()
        self.engine = built.result()  # a failed build raises here, on the caller's thread
        self._output_thread = threading.Thread(target=self._process_outputs, name="trtserve-outputs", daemon=True)
        self._output_thread.start()

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
        if request_id in self._streams:  # checked before touching the live request's queue
            raise InvalidRequest("request_id", f"{request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        prompt_ids = await self.tokenize(prompt)
        await self.engine.grammars.prepare(params)  # structured output (hook): its grammar compiled off this loop
        if request_id in self._streams:  # taken while this one was tokenized
            raise InvalidRequest("request_id", f"{request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        interval = max(self.stream_interval, (params and params.stream_interval) or 1)
        self._streams[request_id] = _Stream(loop, queue, interval)
        try:
            self.engine.add_request(prompt, params, request_id, prompt_ids, resume_token_ids)
            if not self._thread.is_alive():  # the loop ended (shutdown or error) meanwhile
                self.engine.abort(request_id)
                raise RuntimeError(f"engine is not running: {self._error!r}")
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                finished = delta.finished
                yield delta
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as the engine counts them (chat messages through the chat template), off the
        event loop; InvalidRequest naming the problem."""
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.tokenize, prompt)

    async def detokenize(self, token_ids: list[int]) -> str:
        """Token ids' text, special tokens kept, off the event loop; InvalidRequest naming an id outside the
        vocabulary."""
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.detokenize, token_ids)

    async def add_lora(self, name: str, path: str) -> None:
        """Serve another LoRA adapter (read and checked off the event loop); AdapterError naming the problem."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.add_lora, name, path)

    async def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter: True if it left now, False once its requests finish."""
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.remove_lora, name)

    def abort(self, request_id: str) -> bool:
        """Abort a live request now (frees its KV blocks); its stream ends with 'abort'."""
        out = self.engine.abort_tokens(request_id)
        if out is not None:
            self._outputs.put([out])
        return out is not None

    @property
    def context_tokens(self) -> int:
        """The most tokens one sequence can hold (prompt and output)."""
        return self.engine.context_tokens

    def max_prompt_chars(self, cap: int = OPENAI_MAX_STRING) -> int:
        """The most characters a prompt that could fit the context has (longer ones are refused untokenized)."""
        return self.engine.admission.max_prompt_chars(self.context_tokens, cap)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def take_step_records(self) -> list[StepRecord]:
        """The engine steps run since the last call (for metrics that observe each)."""
        return self.engine.take_step_records()

    def take_grammar_compile_seconds(self) -> list[float]:
        """Structured output: the grammar compiles finished since the last call, in seconds each."""
        return self.engine.grammars.take_compile_seconds()

    @property
    def disagg(self) -> Disagg:
        """Prefill/decode disaggregation: this worker's role and the doors' calls (export, expect, pull, forget)."""
        return self.engine.disagg

    def progress(self) -> EngineProgress:
        """Steps run, requests unfinished, and why the engine loop stopped (None while it runs); cheap,
        without the engine's lock (plain reads), for a supervisor's heartbeat."""
        problem = None if self._thread.is_alive() else f"engine loop stopped: {self._error!r}"
        return EngineProgress(self.engine.counters.steps, len(self.engine.requests), problem)

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting requests, let running ones finish (up to the timeout), stop the loop."""
        self._stopping = True
        self._wake.set()
        self._thread.join(drain_timeout_s)
        for request_id in list(self.engine.requests):  # past the timeout: abort the rest
            self.abort(request_id)
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
            self._error = exc
            for request_id in list(self._streams):
                self._deliver_error(request_id, f"engine loop died: {exc!r}")

    def _process_outputs(self) -> None:
        """The output thread: token outputs -> text deltas -> each stream's queue, in order."""
        while (outputs := self._outputs.get()) is not None:
            try:
                for delta in self.engine.outputs.process(outputs):
                    self._deliver(delta)
            except Exception as exc:  # a bug in text handling fails these requests, not the engine
                log.exception("output processing failed")
                for failed in outputs:
                    self.engine.abort_tokens(failed.request_id)
                    self._deliver_error(failed.request_id, f"output processing failed: {exc!r}")

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished and self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # an observer must not take the output thread down
                log.exception("on_finished callback failed")
        stream = self._streams.get(out.request_id)
        if stream is not None:
            due = stream.due(out)
            if due is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, due)

    def _deliver_error(self, request_id: str, message: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RuntimeError(message))

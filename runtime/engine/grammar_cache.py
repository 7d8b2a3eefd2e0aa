"""Structured output's grammars for one engine: compiled once per distinct grammar, off the engine loop, within
a time bound, each request then getting its own matcher (executors/sampling/grammar.py).

Compiles run on a small thread pool (llguidance drops the GIL while it builds a grammar), keyed by the
grammar's hash (GrammarSpec.key): requests with the same schema share one compile, whether it is done or
still running. `prepare` awaits it from an event loop (AsyncLLM, before the request is queued), so neither
the engine loop nor the other streams wait for a slow schema; past `timeout_s` the request is refused with
an InvalidRequest naming its field, while the compile runs on and is cached (a retry finds it), and the
same schema never compiles twice at once. A grammar llguidance refuses is cached as its error. The vocabulary
is prepared for llguidance on the first grammar (about a second for 49k tokens), so an engine that never
sees one pays nothing, not even the import.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from engine_format.grammars import GrammarSpec, llguidance_grammar, short
from executors.sampling import SamplingParams
from executors.sampling.grammar import GrammarCounters, GrammarState, Matcher
from runtime.engine.errors import InvalidRequest
from runtime.engine.stats import GrammarStats

MAX_ENTRIES = 512  # distinct grammars kept (a compiled JSON schema is tens of KB)
WORKERS = 2
MAX_COMPILE_RECORDS = 1024

Compile = Callable[[GrammarSpec], Matcher]  # a pristine matcher for the spec, or InvalidRequest


class GrammarCache:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], timeout_s: float,
                 compile_fn: Compile | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        """`tokenizer`: the engine's Hugging Face tokenizer; `vocab_size`: the model's logits width (may exceed
        the tokenizer's); `eos_token_ids`: what ends a request (a finished grammar allows only these);
        `compile_fn`: tests stand in for llguidance; `clock`: times compiles (the metrics' histogram)."""
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.timeout_s, self.clock = timeout_s, clock
        self._compile_fn = compile_fn or self._compile_llguidance
        self._entries: OrderedDict[str, concurrent.futures.Future[Matcher]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._llg_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.counters = GrammarCounters()
        self._requests = self._hits = self._compiles = self._failures = self._timeouts = 0
        self._compile_seconds: deque[float] = deque(maxlen=MAX_COMPILE_RECORDS)

    async def prepare(self, params: SamplingParams | None) -> None:
        """Compile `params`' grammar (or find it compiled) without blocking the event loop; InvalidRequest if it
        does not compile, or not within the bound. Nothing for a request without a grammar."""
        spec = None if params is None else params.grammar
        if spec is None:
            return
        future = self._future(spec)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._timed_out(spec) from None

    def matcher(self, params: SamplingParams) -> GrammarState | None:
        """A fresh matcher for `params`' grammar (None without one): from the cache, or compiled here within
        the bound (the Python API's path; AsyncLLM prepares first, so this finds it compiled)."""
        spec = params.grammar
        if spec is None:
            return None
        try:
            pristine = self._future(spec).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(spec) from None
        self._requests += 1
        return GrammarState(pristine.deep_copy(), self.vocab_size, self.eos_token_ids, self.counters)

    def stats(self) -> GrammarStats:
        return GrammarStats(
            requests=self._requests, cache_hits=self._hits, compiles=self._compiles, compile_failures=self._failures,
            compile_timeouts=self._timeouts, masked_steps=self.counters.masked_steps,
            violations=self.counters.violations,
        )  # fmt: skip

    def take_compile_seconds(self) -> list[float]:
        """The compile times recorded since the last call (for a histogram that observes each)."""
        with self._lock:
            out = list(self._compile_seconds)
            self._compile_seconds.clear()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _future(self, spec: GrammarSpec) -> concurrent.futures.Future[Matcher]:
        key = spec.key
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return future
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="trtserve-grammar")
            future = self._pool.submit(self._timed_compile, spec)
            self._entries[key] = future
            done = [k for k, f in self._entries.items() if f.done()]
            for old in done[: max(0, len(self._entries) - MAX_ENTRIES)]:  # oldest finished ones first
                del self._entries[old]
            return future

    def _timed_compile(self, spec: GrammarSpec) -> Matcher:
        if self._compile_fn == self._compile_llguidance:
            self._tokenizer()  # once per engine, not part of any grammar's compile time
        start = self.clock()
        try:
            matcher = self._compile_fn(spec)
        except Exception:
            with self._lock:
                self._failures += 1
            raise
        seconds = self.clock() - start
        with self._lock:
            self._compiles += 1
            self._compile_seconds.append(seconds)
        return matcher

    def _timed_out(self, spec: GrammarSpec) -> InvalidRequest:
        self._timeouts += 1
        return InvalidRequest(spec.field, f"the grammar did not compile within {self.timeout_s:g} s "
                                          "(grammar_compile_timeout_s); simplify it")  # fmt: skip

    def _compile_llguidance(self, spec: GrammarSpec) -> Matcher:
        from llguidance import LLMatcher

        try:
            grammar = llguidance_grammar(spec)
        except ValueError as exc:
            raise InvalidRequest(spec.field, short(str(exc))) from None
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(spec.field, short(matcher.get_error()))
        return matcher

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built once (on a compile thread: ~1 s for SmolLM2's)."""
        with self._tokenizer_lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self.eos_token_ids)  # fmt: skip
            return self._llg_tokenizer

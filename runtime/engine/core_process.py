"""The engine core in a process of its own: `python -m runtime.engine.core_process FD` (core_client.py starts it).

Why: in one process, the step loop shares the GIL with the text of every stream (detokenization, stop strings)
and with the event loop that answers them; at hundreds of streams those take as long as a device's step, and
each of their bursts delays the next launch (benchmarks/results/served_path*.md). Here the loop holds a GIL of
its own; the front end (AsyncLLM) keeps the tokenizer, the text and the streams (vLLM's EngineCoreProc).

Three threads: the main one builds the engine and steps it (OpenMP's pools belong to the thread that starts
parallel work, llm_engine.py), handing each step's outputs to the outbox's thread, which sends them without
ever making a step wait for the front end (core_outbox.py); the third reads the front end's messages (adds,
aborts, calls, acknowledgements). Adds and aborts run on that reader in arrival order; calls that may take
long (an adapter read from disk, a grammar compiled) run on a small pool so that aborts never wait behind
them. A decode worker's KV reads run on an event loop thread of their own, answered when they end
(core_pulls.py). The front end closing its end (it exited) stops the core as a shutdown without drain does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from engine_format import EngineConfig
from runtime.engine.core_outbox import Outbox
from runtime.engine.core_pulls import CorePulls
from runtime.engine.core_wire import CALLS, FINAL_CALLS, EngineInfo, error_state
from runtime.engine.heap import freeze_startup_heap
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.outputs import TokenOutput

log = logging.getLogger(__name__)


class EngineCoreProcess:
    def __init__(self, conn: Connection, engine: LLMEngine) -> None:
        self.conn, self.engine = conn, engine
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="trtserve-core-call")
        self.outbox = Outbox(self.send)
        self.pulls = CorePulls(engine.disagg)  # a decode worker's KV reads, on a loop of their own
        self._drain_until: float | None = None  # set by a shutdown: stop once idle, or at this time

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def send_outputs(self, outputs: list[TokenOutput]) -> None:
        self.outbox.put(outputs, self.engine.counters.steps, len(self.engine.requests))

    def run(self) -> None:
        reader = threading.Thread(target=self._read, name="trtserve-core-reader", daemon=True)
        reader.start()
        engine = self.engine
        try:
            while self._drain_until is None or (
                engine.has_unfinished_requests() and time.monotonic() < self._drain_until
            ):
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                self.send_outputs(engine.step_tokens())  # every step, empty too: the front end counts them
        except BaseException as exc:  # the front end fails every stream with it, then sees the process end
            log.exception("engine core loop failed")
            self.outbox.close()
            self._send_quietly(("died", f"engine loop died: {exc!r}"))
            return
        for request_id in list(engine.requests):  # past the drain: abort the rest
            self._abort(request_id, "abort")
        self.outbox.close()  # every output before "closed"
        self._calls.shutdown(wait=True, cancel_futures=True)
        self.pulls.close()  # reads still running cancelled, before the connector closes
        engine.close()  # the KV tiers write to disk
        self._send_quietly(("closed", {name: self._resolve(name)() for name in FINAL_CALLS}))

    def _read(self) -> None:
        """Until the front end closes its end: while a shutdown drains, aborts and calls are still answered
        (a model's metrics), adds refused."""
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                kind = message[0]
                if kind == "add":
                    self._add(message[1:])
                elif kind == "ack":
                    self.outbox.ack()
                elif kind == "abort":
                    self._abort(*message[1:])
                elif kind == "call":
                    try:
                        self._calls.submit(self._call, *message[1:])
                    except RuntimeError:  # the pool is shut: the core has closed (its last answers went out)
                        self._send_quietly(("reply", message[1], error_state(RuntimeError("engine core closed")), None))
                elif kind == "shutdown":
                    self._stop(message[1])
        except (EOFError, OSError):  # the front end is gone: nobody to answer
            self._stop(0.0)

    def _stop(self, drain_timeout_s: float) -> None:
        self._drain_until = time.monotonic() + drain_timeout_s
        self._wake.set()

    def _add(self, add: tuple) -> None:
        """An "add" message's fields, as `_add_now` takes them."""
        params = add[4]
        if params is not None and params.grammar is not None:  # its compile must not hold up aborts
            self._calls.submit(self._add_now, *add)
        else:
            self._add_now(*add)

    def _add_now(
        self,
        call_id: int,
        request_id: str,
        prompt: Any,
        prompt_ids: list[int],
        params: Any,
        resume_token_ids: list[int],
    ) -> None:
        try:
            if self._drain_until is not None:
                raise RuntimeError("engine is shutting down")
            self.engine.add_request(prompt, params, request_id, prompt_ids, resume_token_ids)
        except Exception as exc:
            self.send(("reply", call_id, error_state(exc), None))
            return
        self.send(("reply", call_id, None, None))
        self._wake.set()

    def _abort(self, request_id: str, reason: str) -> None:
        out = self.engine.abort_tokens(request_id, reason)
        if out is not None:
            self.send_outputs([out])

    def _call(self, call_id: int, name: str, args: tuple) -> None:
        """Run a call and reply with its value or error; a call that returns a future (a KV read) is answered
        when the future is done."""
        try:
            value = self._resolve(name)(*args)
        except Exception as exc:
            self._send_quietly(("reply", call_id, error_state(exc), None))
            return
        if isinstance(value, Future):
            value.add_done_callback(lambda done: self._reply_when_done(call_id, done))
            return
        self._send_quietly(("reply", call_id, None, value))

    def _reply_when_done(self, call_id: int, done: Future) -> None:
        error = RuntimeError("cancelled in the engine core") if done.cancelled() else done.exception()
        if error is not None:
            self._send_quietly(("reply", call_id, error_state(error), None))
        else:
            self._send_quietly(("reply", call_id, None, done.result()))

    def _resolve(self, name: str) -> Any:
        """The engine's method `name` (dotted: of one of its parts), if it is one of CALLS; a KV read and its
        cleanup are the core's own (core_pulls.py)."""
        if name not in CALLS:
            raise ValueError(f"{name!r} is not an engine call ({', '.join(sorted(CALLS))})")
        if name in ("disagg.pull", "disagg.forget"):
            return getattr(self.pulls, name.partition(".")[2])
        target: Any = self.engine
        for part in name.split("."):
            target = getattr(target, part)
        return target

    def _send_quietly(self, message: tuple) -> None:
        """Send unless the front end is gone (then there is nobody to tell)."""
        with contextlib.suppress(OSError):
            self.send(message)


def main(fd: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop (a terminal's ^C reaches both)
    conn = Connection(fd)
    kind, engine_dir, args, backend_factory = pickle.loads(conn.recv_bytes())
    assert kind == "start", kind
    try:
        backend = None
        if backend_factory is not None:  # benchmarks and tests: a backend built from the engine's config
            backend = backend_factory(EngineConfig.load(engine_dir))
        engine = LLMEngine(engine_dir, args, backend=backend)
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("failed", error_state(exc))))
        raise SystemExit(1) from None
    info = EngineInfo(engine.context_tokens, engine.kv.capacity_tokens, os.getpid())
    freeze_startup_heap("engine core")
    core = EngineCoreProcess(conn, engine)
    core.send(("ready", info))
    core.run()


if __name__ == "__main__":
    main(int(sys.argv[1]))

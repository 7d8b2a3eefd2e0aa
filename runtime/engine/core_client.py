"""The front end's handle on an engine core in a process of its own (core_process.py; the wire: core_wire.py).

`EngineCoreClient` starts the process (`wait_ready`: until its engine is built) and then speaks for it: `add` and
`call` return futures answered by the core, `abort` is sent and forgotten (the final output comes back in
order with the steps'), and `receive` hands the front end's output thread each step's outputs, answering the
futures on the way. If the core dies, every pending future fails and `receive` says why.

Requests are named by the front end's engine ids (runtime/request_ids.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from engine_format import EngineConfig
from executors.base import EngineBackend
from executors.sampling import SamplingParams
from runtime.engine.admission import Prompt
from runtime.engine.core_wire import EngineInfo, rebuild_error, unpack_outputs
from runtime.engine.disagg import DisaggStats
from runtime.engine.engine_args import EngineArgs
from runtime.engine.kv_import import Import, PullRecord
from runtime.engine.outputs import TokenOutput

# Builds a benchmark's or a test's backend inside the core process (picklable: a module-level callable).
BackendFactory = Callable[[EngineConfig], EngineBackend]


class EngineCoreDied(RuntimeError):
    """The core process's loop failed or the process ended; the message says how."""


def _python() -> str:
    """This interpreter, or (inside Triton's stub, whose executable is not Python) the one on PATH."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


class EngineCoreClient:
    def __init__(self, engine_dir: str | Path, args: EngineArgs, backend_factory: BackendFactory | None = None):
        """Start the core; `wait_ready` waits for its engine."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        self.process = subprocess.Popen(
            [_python(), "-m", "runtime.engine.core_process", str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._futures_lock = threading.Lock()
        self._call_ids = itertools.count()
        self.steps = 0  # as of the last step received
        self.unfinished = 0
        self._unacknowledged = False  # the outputs `receive` returned last are not yet acknowledged
        self.problem: str | None = None  # why the core stopped, once it has
        self._final: dict[str, Any] = {}  # FINAL_CALLS' answers, once the core has closed
        self._send(("start", str(engine_dir), args, backend_factory))

    def wait_ready(self) -> EngineInfo:
        """Until the core's engine is built (meanwhile the caller may load what it needs); its build error
        raised here, as in-process."""
        try:
            reply = self._recv()
        except EOFError:
            raise EngineCoreDied(f"engine core process exited with code {self.process.wait()}") from None
        if reply[0] == "failed":
            self.process.wait()
            raise rebuild_error(reply[1])
        return reply[1]

    # ---- to the core -------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt: Prompt,
        prompt_ids: list[int],
        params: SamplingParams | None,
        resume_token_ids: Sequence[int],
    ) -> concurrent.futures.Future[None]:
        """Queue a request in the core: a future that fails with its admission error (InvalidRequest, Overloaded)."""
        call_id, future = self._future()
        self._send(("add", call_id, request_id, prompt, prompt_ids, params, list(resume_token_ids)))
        return future

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Finish the request in the core, its KV blocks freed; its final output arrives with the steps'."""
        self._send(("abort", request_id, reason))

    def call(self, name: str, *args: Any) -> concurrent.futures.Future[Any]:
        """One of core_wire.CALLS, run in the core: the future holds its value or its error. Once the core has
        closed, FINAL_CALLS are answered as it closed (a `take_` call's records once)."""
        if name in self._final:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            value = self._final[name]
            if name.rpartition(".")[2].startswith("take_"):
                self._final[name] = []
            future.set_result(value)
            return future
        call_id, future = self._future()
        self._send(("call", call_id, name, args))
        return future

    def shutdown(self, drain_timeout_s: float) -> None:
        """Ask the core to stop once its requests finish (up to the timeout; the rest are aborted)."""
        self._send(("shutdown", drain_timeout_s))

    # ---- from the core (the front end's output thread) ---------------------------------------

    def receive(self) -> list[TokenOutput] | None:
        """The next outputs (answering calls meanwhile): a step's, or several steps' merged while the caller was
        busy with those returned before, which this call acknowledges (core_outbox.py); None once the core has
        closed. EngineCoreDied if its loop failed or the process ended without closing."""
        if self._unacknowledged:
            self._unacknowledged = False
            with contextlib.suppress(EngineCoreDied):  # (gone: the read below says how)
                self._send(("ack",))
        while True:
            try:
                message = self._recv()
            except (EOFError, OSError):
                self._die(f"engine core process exited with code {self.process.wait()}")
            kind = message[0]
            if kind == "out":
                _, self.steps, self.unfinished, packed = message
                self._unacknowledged = True
                return unpack_outputs(packed)
            if kind == "reply":
                _, call_id, error, value = message
                with self._futures_lock:
                    future = self._futures.pop(call_id)
                # (cancelled, its caller gone: a KV read's, which asyncio.wrap_future cancels with its awaiter)
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    if error is None:
                        future.set_result(value)
                    else:
                        future.set_exception(rebuild_error(error))
            elif kind == "died":
                self._die(message[1])
            elif kind == "closed":
                self._final = message[1]
                self._fail_pending("engine core closed")
                return None

    def close(self, timeout_s: float = 30.0) -> None:
        """After `receive` returned None (or the core died): reap the process, killing it past the timeout."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._conn.close()

    # ---- the wire ----------------------------------------------------------------------------

    def _future(self) -> tuple[int, concurrent.futures.Future]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._futures_lock:  # (with _fail_pending's: no future is registered after the last are failed)
            if self.problem is not None:
                raise EngineCoreDied(self.problem)
            call_id = next(self._call_ids)
            self._futures[call_id] = future
        return call_id, future

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as exc:
            raise EngineCoreDied(self.problem or f"engine core process is gone: {exc}") from None

    def _recv(self) -> tuple:
        return pickle.loads(self._conn.recv_bytes())

    def _die(self, problem: str) -> NoReturn:
        self._fail_pending(problem)
        raise EngineCoreDied(problem)

    def _fail_pending(self, why: str) -> None:
        with self._futures_lock:
            self.problem = self.problem or why
            pending, self._futures = self._futures, {}
        for future in pending.values():
            future.set_exception(EngineCoreDied(why))


class CoreProcessDisagg:
    """The disaggregation doors of a front end whose core runs in its own process: each call crosses to the
    core's Disagg (a KV read runs there on a loop of its own, core_pulls.py, and its reply comes when it ends).
    The front end keeps the first token of each request's handle, which its detokenizer needs."""

    def __init__(self, client: EngineCoreClient, role: str) -> None:
        self.client, self.role = client, role
        self._first_tokens: dict[str, int] = {}  # request id -> its handle's first token, while the core holds it

    def export(self, request_id: str) -> None:
        self.client.call("disagg.export", request_id).result()

    def expect(self, request_id: str, handle_text: str, cache_salt: str | None, lora: str | None = None) -> Import:
        imp = self.client.call("disagg.expect", request_id, handle_text, cache_salt, lora).result()
        self._first_tokens[request_id] = imp.handle.first_token
        return imp

    def first_tokens(self, request_id: str) -> list[int]:
        """The token the core takes from the request's handle as already answered (its text went out from the
        prefill worker): the front end's detokenizer needs it as context, as the core's adoption resumes it."""
        return [self._first_tokens[request_id]] if request_id in self._first_tokens else []

    async def pull(self, imp: Import) -> None:
        """The core reads the KV (nothing to read for a `recompute` handle). Cancelled here (the caller left),
        the read goes on in the core until `forget`, which the door calls as the request ends."""
        if not imp.handle.recompute:
            await asyncio.wrap_future(self.client.call("disagg.pull", imp.request_id))

    def forget(self, request_id: str) -> None:
        self._first_tokens.pop(request_id, None)
        self.client.call("disagg.forget", request_id)  # answered in the core's order; nobody waits for it

    def stats(self) -> DisaggStats:
        return self.client.call("disagg.stats").result()

    def take_pull_records(self) -> list[PullRecord]:
        return self.client.call("disagg.take_pull_records").result()

"""A served request's client cancellation: Triton's `is_cancelled()`, asked on a timer, aborts the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from runtime.engine.outputs import RequestOutput
from runtime.triton_model.settings import CANCEL_POLL_S


class Cancellable(Protocol):
    """What the watch asks of a pb_utils.InferenceRequest."""

    def is_cancelled(self) -> bool: ...


async def until_cancelled(
    stream: Any, request: Cancellable, poll_s: float = CANCEL_POLL_S
) -> AsyncIterator[RequestOutput]:
    """Yield the stream's deltas; stop (aborting the request) once the client cancels.

    `is_cancelled()` is an IPC round trip to the Triton process, so a timer asks it every `poll_s`
    per request, whether deltas are flowing or not, and cancels the serving task when it says yes;
    the request is aborted as the cancellation unwinds AsyncLLM.generate. Asking on every delta
    woke Triton hundreds of times a second under load, and each wake-up stalls one of the kernel's
    two threads on a 2-core machine (c32: 67-68 -> 72 tok/s without them). Watching with a timer,
    not a task and an `asyncio.wait` per delta, keeps a delta's cost to the queue hand-off: this
    thread's per-token Python holds the GIL that the engine thread needs between its ops.
    With `poll_s` 0 it is asked before each delta is passed on (and every CANCEL_POLL_S while
    none comes, e.g. while the request waits to be scheduled).
    It must not be asked once the final response is sent (Triton frees the response factory
    then): the caller closes this generator (`contextlib.aclosing`) before it returns, and the
    timer stops with it."""
    watch = CancelWatch(request, poll_s or CANCEL_POLL_S)
    try:
        async for delta in stream:
            if poll_s == 0 and request.is_cancelled():
                break  # leaving the stream unfinished: closing it aborts the request
            yield delta
            if delta.finished:
                return
    except asyncio.CancelledError:
        if not watch.cancelled:
            raise  # not the client's: e.g. the drain deadline
        uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()  # handled: the request was aborted as the error unwound
    finally:
        watch.stop()
        await stream.aclose()  # a no-op once finished; otherwise aborts the request, its KV blocks freed now


class CancelWatch:
    """Asks `request.is_cancelled()` every `poll_s` seconds on the running loop; when it says yes,
    cancels the task that created the watch."""

    def __init__(self, request: Cancellable, poll_s: float) -> None:
        self.request, self.poll_s, self.cancelled = request, poll_s, False
        task = asyncio.current_task()
        assert task is not None, "a watch is made by the task it cancels"
        self._task = task
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(poll_s, self._check)

    def _check(self) -> None:
        if self.request.is_cancelled():
            self.cancelled = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_later(self.poll_s, self._check)

    def stop(self) -> None:
        self._timer.cancel()

"""KV reads in the engine core's own process (core_process.py): a decode worker's `pull`s over the wire.

With the core in this process, the front end's door (runtime/request_ids.py) asks for a request's read by its
id, and the reply comes when the read has ended. Each read is `Disagg.pull`, a coroutine that polls the
connector while the engine steps: they all run on one event loop thread of their own, so hundreds of reads take
one thread, and calls never wait behind a read. `forget` runs on that loop too: a read still running is cancelled
first (its own cleanup cancels the transfer and frees what it staged), and only then are the request's marks
dropped, so the connector is never touched by two threads for one read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading

from runtime.engine.disagg import Disagg, KVTransferError


class CorePulls:
    def __init__(self, disagg: Disagg) -> None:
        self.disagg = disagg
        self._loop = asyncio.new_event_loop()
        self._running: dict[str, asyncio.Task] = {}  # request id -> its read (the loop's thread only)
        self._thread = threading.Thread(target=self._loop.run_forever, name="trtserve-kv-pulls", daemon=True)
        self._thread.start()

    def pull(self, request_id: str) -> concurrent.futures.Future[None]:
        """Read the KV of the handle `expect` registered for the request: a future done when the read is
        (KVTransferError or Overloaded if it could not be, everything staged freed)."""
        return asyncio.run_coroutine_threadsafe(self._pull(request_id), self._loop)

    def forget(self, request_id: str) -> None:
        """The request ended or never started: its read cancelled, then its marks dropped (Disagg.forget)."""
        asyncio.run_coroutine_threadsafe(self._forget(request_id), self._loop).result()

    def close(self) -> None:
        """Cancel the reads still running (each frees what it staged) and stop the loop; before the engine closes
        its connector."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _pull(self, request_id: str) -> None:
        imp = self.disagg.imports.get(request_id)
        if imp is None:
            raise KVTransferError(f"no KV handle is registered for request {request_id!r} (expired or forgotten)")
        task = asyncio.current_task()
        assert task is not None
        self._running[request_id] = task
        try:
            await self.disagg.pull(imp)
        finally:
            self._running.pop(request_id, None)

    async def _forget(self, request_id: str) -> None:
        task = self._running.get(request_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):  # the puller's error: it has gone
                await task
        self.disagg.forget(request_id)

    async def _cancel_all(self) -> None:
        for request_id in list(self._running):
            await self._forget(request_id)

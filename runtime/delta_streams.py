"""A streaming request's way from AsyncLLM's output thread to its caller's event loop.

Each stream holds its deltas until its caller takes them. The output thread hands them over with
`loop.call_soon_threadsafe`: one call per delta (`DeltaStream.send`), or one call per step for every stream
of a loop (`send_step`), which wakes the loop once instead of once a stream: at hundreds of streams the
wake-ups are most of the loop's work. With `coalesce`, a delta that finds an earlier one still untaken
joins it (vLLM's output collector does the same): a caller that falls behind gets fewer, longer deltas,
and the loop's work per step stops growing with how far behind it is.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Iterable

from runtime.engine.outputs import RequestOutput

Item = RequestOutput | BaseException  # an exception ends the stream with it


class DeltaStream:
    def __init__(self, loop: asyncio.AbstractEventLoop, interval: int, coalesce: bool) -> None:
        """`interval`: tokens a delta waits for (the first and the final go at once)."""
        self.loop, self.interval, self.coalesce = loop, interval, coalesce
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._held: RequestOutput | None = None  # (the output thread's) tokens short of an interval
        self._started = False  # the first delta went out

    # ---- the output thread -----------------------------------------------------------------

    def due(self, out: RequestOutput) -> RequestOutput | None:
        """`out` merged after what is held, if it is due now (the first, the final, or a full
        interval's tokens); else None, and it is held."""
        if self._held is not None:
            out, self._held = self._held.merge(out), None
        if out.finished or not self._started or len(out.token_ids) >= self.interval:
            self._started = True
            return out
        self._held = out
        return None

    def send(self, item: Item) -> None:
        """Hand one item to the caller's loop (from any thread)."""
        self.loop.call_soon_threadsafe(self.put, item)

    # ---- the caller's loop -------------------------------------------------------------------

    def put(self, item: Item) -> None:
        last = self._items[-1] if self._items else None
        if self.coalesce and isinstance(last, RequestOutput) and isinstance(item, RequestOutput):
            self._items[-1] = last.merge(item)
        else:
            self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The next delta; raises the exception that ended the stream."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


def send_step(items: Iterable[tuple[DeltaStream, Item]]) -> None:
    """Hand a step's items to their streams' loops: one call per loop (from any thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaStream, Item]]] = defaultdict(list)
    for stream, item in items:
        by_loop[stream.loop].append((stream, item))
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[DeltaStream, Item]]) -> None:
    for stream, item in batch:
        stream.put(item)

"""One client request's upstream work: an admission slot, n choices fanned out, replicas, cascade, cleanup.

Each choice runs as a task feeding one event queue (streams interleave as tokens arrive).
`close()` is called from wherever the request ends first: the response is done, the client
disconnected (the disconnect watcher, or Starlette cancelling a stream), or an error. It
cancels unfinished upstream calls (Triton aborts those requests) and releases the queue slot;
the cleanup runs in its own task, so it completes even when the caller is being cancelled
(anyio cancels every await inside a cancelled stream's scope).

Each upstream generation goes to a replica its backend's pool picks. When that replica fails (unreachable,
not ready, its engine overloaded, the stream cut) before the generation produced anything, it is retried
on another replica, up to `max_attempts` replicas. Once a delta has been passed on, a resumable stream
(GenerateRequest.resumable: the client did not opt out) is resumed instead, up to `max_attempts` times: sent
again with the token ids passed on so far as `resume_token_ids`, on another replica or on the same one once it
is back, the client seeing a pause; any other failure after a delta is the client's (a stream gets an error
event). Non-streaming generations produce their one delta at the end, so they are retried whenever their
replica fails. When no replica is healthy at all and the backend has served before (a tritonserver
restarting: `trtserve serve`'s supervisor brings it back on its address), a generation that has produced
nothing (or a stream to resume) waits for one to be ready again, then is tried again there (restarted replicas
included): up to the routing's `ready_wait_s` in all its waits (a stream that passed a delta on since gets it
afresh); past it, a 503. Only the time spent waiting counts: an attempt on a replica that came back may sit in
its queue for long before that replica fails again, and that outage gets what is left. A replica that
refused because it is shutting down (its drain) is not waited for: 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace

from runtime.gateway.disagg import DisaggPools, disaggregated
from runtime.gateway.errors import GatewayError, client_gone
from runtime.gateway.replicas import ReplicaPool
from runtime.gateway.routing import RouteDecision, Router
from runtime.gateway.upstream import DRAINING_CODE
from runtime.gateway.wire import Delta, GenerateRequest

RETRYABLE = frozenset({429, 502, 503})  # overloaded engine, stream cut, replica unreachable or not ready

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    index: int  # the choice
    delta: Delta


class Exchange:
    def __init__(self, decision: RouteDecision, pools: dict[str, ReplicaPool], router: Router,
                 requests: list[GenerateRequest], stream: bool, want_logprobs: bool,
                 on_client_left: Callable[[], None] = lambda: None,
                 disagg: dict[str, DisaggPools] | None = None) -> None:  # fmt: skip
        self.decision = decision
        self._pools, self._router = pools, router
        self._disagg = disagg or {}  # backends served by prefill + decode pools (runtime/gateway/disagg.py)
        self.requests, self._stream, self._want_logprobs = requests, stream, want_logprobs
        self._on_client_left = on_client_left  # called once if a leaving client cut upstream work short
        self._events: asyncio.Queue[Event | GatewayError] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = asyncio.Event()
        self._closer: asyncio.Future[None] | None = None
        self._slot: AbstractAsyncContextManager[float] | None = None
        self._pending = set(range(len(requests)))  # choices not finished yet
        self.escalated = False
        self.discarded_tokens: dict[str, int] = {"prompt": 0, "completion": 0}  # escalated small answers
        self.closed = False

    @property
    def model(self) -> str:
        """The model named in the response: the strong one once any choice escalated."""
        return self.decision.escalate_to if self.escalated and self.decision.escalate_to else self.decision.model

    @property
    def finished(self) -> bool:
        return not self._pending

    async def start(self, slot: AbstractAsyncContextManager[float], immediate: bool = False) -> float:
        """Take the admission slot (FairQueue.slot; its QueueFull propagates), then start every choice.
        A close() while still queued ends the wait with the 499 error. `immediate`: the slot is granted
        without waiting (FairQueue.can_start), so nothing can close the exchange meanwhile: entered directly,
        without the two tasks that race a wait against close()."""
        if immediate and not self.closed:
            waited = await slot.__aenter__()
            self._slot = slot
            self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self.requests)]
            return waited
        admission = asyncio.ensure_future(slot.__aenter__())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({admission, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not admission.done():  # closed, or this handler cancelled: leave the queue
                admission.cancel()
        if admission.cancelled() or not admission.done():
            raise client_gone()
        waited = admission.result()
        self._slot = slot
        if self.closed:  # closed as the slot was granted
            await self._release()
            raise client_gone()
        self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self.requests)]
        return waited

    async def next(self) -> Event:
        """The next event of any choice; raises the first GatewayError a choice hits."""
        item = await self._events.get()
        if isinstance(item, GatewayError):
            raise item
        if item.delta.finish_reason is not None:
            self._pending.discard(item.index)
        return item

    async def events(self) -> AsyncIterator[Event]:
        while not self.finished:
            yield await self.next()

    async def close(self, client_left: bool = False) -> None:
        """Cancel what still runs and release the slot (idempotent; completes even if the caller is cancelled)."""
        if self._closer is None:
            self.closed = True
            if client_left and self._tasks and not self.finished:
                self._on_client_left()
            self._closing.set()
            self._closer = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._closer)

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:  # the generators' finally blocks cancel their gRPC calls
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._release()
        self._events.put_nowait(client_gone())  # wakes a reader still waiting for events

    async def _release(self) -> None:
        if self._slot is not None:
            slot, self._slot = self._slot, None
            await slot.__aexit__(None, None, None)

    async def _pump(self, index: int, request: GenerateRequest) -> None:
        try:
            async for delta in self._choice(request):
                self._events.put_nowait(Event(index, delta))
        except GatewayError as exc:
            self._events.put_nowait(exc)
        except Exception as exc:  # a bug must fail the request, not leave its client waiting forever
            log.exception("choice %d failed", index)
            self._events.put_nowait(GatewayError(500, f"gateway error: {type(exc).__name__}", "server_error"))

    async def _choice(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        decision = self.decision
        if decision.escalate_to is None:
            async for delta in self._generate(decision.model, request, self._stream):
                yield delta
            return
        # Cascade: the small model answers whole, with logprobs, so its confidence can be judged.
        probe = replace(request, params={**request.params, "logprobs": request.params.get("logprobs", 0)})
        deltas = [delta async for delta in self._generate(decision.model, probe, stream=False)]
        logprobs = [lp.logprob for delta in deltas for lp in delta.logprobs]
        mean = sum(logprobs) / len(logprobs) if logprobs else None  # None: unknown, the router escalates
        if self._router.should_escalate(decision, mean):
            self.escalated = True
            if deltas:  # the small model's answer was generated, then thrown away: still counted
                self.discarded_tokens["prompt"] += deltas[-1].prompt_tokens
                self.discarded_tokens["completion"] += deltas[-1].completion_tokens
            async for delta in self._generate(decision.escalate_to, request, self._stream):
                yield delta
            return
        for delta in deltas:
            yield delta if self._want_logprobs else replace(delta, logprobs=[])

    async def _generate(self, backend: str, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        """One generation of `backend`: on one of its replicas, or, disaggregated, on a prefill then a decode worker."""
        disagg = self._disagg.get(backend)
        if disagg is None or "prompt_logprobs" in request.params or request.tokenize:  # on one worker
            async for delta in self._generate_on(self._pools[backend], request, stream):
                yield delta
            return
        prefill = self._generate_on(disagg.prefill, replace(request, prefill_only=True), stream=False)
        async for delta in disaggregated(disagg, request, stream, prefill):
            yield delta

    async def _generate_on(self, pool: ReplicaPool, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        """One generation on a replica of `pool`, retried on others while nothing has been yielded; a resumable
        stream cut by its replica's failure goes on elsewhere, or there once it is back (see the module)."""
        backend = pool.name
        hashes = pool.prefix_key(request)
        tried: set[str] = set()
        failed: GatewayError | None = None
        wait_left: float | None = None  # seconds of ready_wait_s not yet spent waiting for a replica to come back
        answer: list[int] = []  # the token ids passed on (a resumable stream's)
        resumes = 0
        while True:
            try:  # no await between the pick and its lease: concurrent picks see each other's counts
                pick = pool.pick(hashes, frozenset(tried), request.lora)
            except GatewayError as none_left:
                draining = failed is not None and failed.code == DRAINING_CODE  # shutting down: not coming back
                if pool.healthy or not pool.ever_healthy or draining:  # the others were tried, or it never served
                    raise (failed or none_left) from None  # e.g. the failed one's own 429
                loop = asyncio.get_running_loop()
                wait_left = pool.settings.ready_wait_s if wait_left is None else wait_left
                began = loop.time()
                back = await pool.wait_healthy(wait_left)
                wait_left -= loop.time() - began
                if not back:
                    last = f" (last failure: {failed.message})" if failed is not None else ""
                    raise GatewayError.unavailable(f"no replica of backend {backend!r} was ready again within "
                                                   f"{pool.settings.ready_wait_s:g} s{last}") from None  # fmt: skip
                tried.clear()  # back (restarted, perhaps): every replica may be tried again
                continue
            tried.add(pick.replica.url)
            started = False
            try:
                with pool.lease(pick, hashes) as upstream:
                    async for delta in upstream.generate(request, stream):
                        started = True
                        answer.extend(delta.token_ids)
                        yield delta
                return
            except GatewayError as exc:
                resume = started and request.resumable and resumes < pool.settings.max_attempts
                if exc.status not in RETRYABLE or (started and not resume):
                    raise
                if resume:
                    resumes += 1
                    request = request.resumed(answer)
                    failed, wait_left = exc, None
                    pool.metrics.streams_resumed.labels(backend, pick.replica.url).inc()
                    log.warning(
                        "replica %s of %s failed mid-stream (%s); resuming after %d tokens",
                        pick.replica.url,
                        backend,
                        exc.message,
                        len(answer),
                    )
                    continue
                if len(tried) >= pool.settings.max_attempts:
                    raise
                failed = exc
                pool.metrics.replica_retries.labels(backend, pick.replica.url).inc()
                log.warning("replica %s of %s failed before its first token (%s); retrying",
                            pick.replica.url, backend, exc.message)  # fmt: skip

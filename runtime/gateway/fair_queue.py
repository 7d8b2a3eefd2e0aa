"""Bounded fair admission queue: caps upstream concurrency globally and per key, serves keys round-robin.

One event loop owns a FairQueue (no locks: every state change happens between awaits). Slots are handed
directly to the next waiter on release, so a newcomer can never barge ahead of a woken waiter and a wake-up
is never lost. The invariant kept after every change: no queued waiter is eligible while capacity remains,
so an arrival that is eligible right away may start at once without overtaking anyone.

A key may have its own limits (KeyLimits: a tenant's, runtime.gateway.tenants): its concurrency replaces
per_key_concurrency, and its max_queued bounds how many of its requests wait (on top of the global bound).

Keys appear as Prometheus label values: pass a tenant name, never a raw API key. The per-key series go
to `key_registry` (the gateway keeps them off its public /metrics: who is busy is a tenant's business).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Retry-After estimate: mean service time before any request has completed, its smoothing, and clamps.
DEFAULT_SERVICE_S = 1.0
SERVICE_EWMA_ALPHA = 0.2
RETRY_AFTER_MIN_S = 0.1
RETRY_AFTER_MAX_S = 60.0


class QueueFull(Exception):
    """Raised by FairQueue.slot when max_queued requests already wait (the gateway answers 429)."""

    def __init__(self, key: str, depth: int, retry_after_s: float, own: bool = False) -> None:
        whose = "your tenant's request queue" if own else "request queue"
        super().__init__(f"{whose} is full ({depth} waiting); retry after {retry_after_s:.1f}s")
        self.key = key
        self.depth = depth
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class KeyLimits:
    """One key's own limits (a tenant's); None: the queue's defaults."""

    max_concurrent: int | None = None  # requests holding a slot at once (default: per_key_concurrency)
    max_queued: int | None = None  # requests waiting for a slot (default: only the global max_queued)

    def __post_init__(self) -> None:
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")


@dataclass(eq=False)  # identity equality: deque.remove must find this waiter, not an equal one
class _Waiter:
    key: str
    future: asyncio.Future[None]
    queued: bool = True
    granted: bool = False


@dataclass(frozen=True)
class _Metrics:
    depth: Gauge
    in_flight: Gauge
    key_in_flight: Gauge
    wait: Histogram
    rejections: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, key_registry: CollectorRegistry) -> _Metrics:
        return cls(
            depth=Gauge("trtserve_gateway_queue_depth", "Requests waiting for an upstream slot", registry=registry),
            in_flight=Gauge("trtserve_gateway_in_flight", "Requests holding an upstream slot", registry=registry),
            key_in_flight=Gauge(
                "trtserve_gateway_key_in_flight",
                "Requests holding an upstream slot, per key",
                ["key"],
                registry=key_registry,
            ),
            wait=Histogram(
                "trtserve_gateway_queue_wait_seconds",
                "Time from arrival to holding an upstream slot (admitted requests)",
                buckets=WAIT_BUCKETS,
                registry=registry,
            ),
            rejections=Counter(
                "trtserve_gateway_queue_rejections",
                "Requests refused because the queue was full (globally, or for their key)",
                ["key"],
                registry=key_registry,
            ),
        )


class FairQueue:
    """Admission control in front of the upstreams; see `slot`.

    registry: where the `trtserve_gateway_*` metrics register; None gives a private registry (counted, not
    exported), so several queues can coexist in one process. key_registry: where the per-key series go
    (default: `registry`). key_limits: keys with limits of their own.
    """

    def __init__(
        self,
        max_queued: int,
        max_concurrent: int,
        per_key_concurrency: int,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        key_limits: Mapping[str, KeyLimits] | None = None,
        key_registry: CollectorRegistry | None = None,
    ) -> None:
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if per_key_concurrency < 1:
            raise ValueError(f"per_key_concurrency must be >= 1, got {per_key_concurrency}")
        self.max_queued = max_queued
        self.max_concurrent = max_concurrent
        self.per_key_concurrency = per_key_concurrency
        self._clock = clock
        self.key_limits = dict(key_limits or {})
        registry = registry if registry is not None else CollectorRegistry()
        self._metrics = _Metrics.create(registry, key_registry if key_registry is not None else registry)
        # Waiters per key, FIFO within a key; dict order = order keys started waiting (round-robin tie-break).
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._depth = 0
        self._in_flight = 0
        self._per_key: dict[str, int] = {}
        # Sequence number of each active key's latest grant: the least recently served key goes next.
        self._last_grant: dict[str, int] = {}
        self._grants = 0
        self._service_s: float | None = None

    @property
    def depth(self) -> int:
        """Requests waiting for a slot."""
        return self._depth

    @property
    def in_flight(self) -> int:
        """Requests holding a slot."""
        return self._in_flight

    @property
    def per_key_in_flight(self) -> dict[str, int]:
        """Slots held per key (keys holding none are absent); a copy."""
        return dict(self._per_key)

    @property
    def retry_after_s(self) -> float:
        """How long a refused client should wait: the time the current backlog needs to drain.

        (depth + 1) requests ahead of a retry pass through max_concurrent slots, each taking the mean recent
        service time (an exponentially weighted average of slot hold times, DEFAULT_SERVICE_S before the first
        completes); clamped to [RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S].
        """
        return self._drain_s(self._depth, self.max_concurrent)

    def key_retry_after_s(self, key: str) -> float:
        """How long a client refused for its own key's bound should wait: that key's waiters drain through the
        slots it holds now (at least one), not the whole queue's."""
        return self._drain_s(len(self._waiting.get(key, ())), max(1, self._per_key.get(key, 0)))

    def _drain_s(self, waiting: int, slots: int) -> float:
        service = self._service_s if self._service_s is not None else DEFAULT_SERVICE_S
        return min(max(service * (waiting + 1) / slots, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)

    def can_start(self, key: str) -> bool:
        """Whether `slot(key)` would be granted now, without waiting (nor raising QueueFull)."""
        return self._eligible(key)

    @asynccontextmanager
    async def slot(self, key: str) -> AsyncIterator[float]:
        """Hold one upstream slot for `key`; yields the seconds spent waiting for it.

        Raises QueueFull at once when max_queued requests already wait, or its key's own max_queued do (then
        with that key's own Retry-After estimate). The slot is released on any exit
        (normal, exception, cancellation); a waiter cancelled while queued leaves the queue.
        """
        arrived = self._clock()
        if self._eligible(key):
            self._grant(key)
        elif self._depth >= self.max_queued:
            self._metrics.rejections.labels(key).inc()
            raise QueueFull(key, self._depth, self.retry_after_s)
        elif self._key_queue_full(key):
            self._metrics.rejections.labels(key).inc()
            raise QueueFull(key, len(self._waiting.get(key, ())), self.key_retry_after_s(key), own=True)
        else:
            await self._wait(key)
        granted_at = self._clock()
        waited = granted_at - arrived
        self._metrics.wait.observe(waited)
        try:
            yield waited
        finally:
            self._release(key, self._clock() - granted_at)

    def concurrency(self, key: str) -> int:
        """Slots `key` may hold at once."""
        limits = self.key_limits.get(key)
        return limits.max_concurrent if limits and limits.max_concurrent is not None else self.per_key_concurrency

    def _key_queue_full(self, key: str) -> bool:
        limits = self.key_limits.get(key)
        return limits is not None and limits.max_queued is not None and (
            len(self._waiting.get(key, ())) >= limits.max_queued)  # fmt: skip

    def _eligible(self, key: str) -> bool:
        return self._in_flight < self.max_concurrent and self._per_key.get(key, 0) < self.concurrency(key)

    def _grant(self, key: str) -> None:
        self._in_flight += 1
        self._per_key[key] = self._per_key.get(key, 0) + 1
        self._grants += 1
        self._last_grant[key] = self._grants
        self._metrics.in_flight.set(self._in_flight)
        self._metrics.key_in_flight.labels(key).set(self._per_key[key])

    async def _wait(self, key: str) -> None:
        waiter = _Waiter(key, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(key, deque()).append(waiter)
        self._set_depth(self._depth + 1)
        try:
            await waiter.future
        except BaseException:
            if waiter.granted:  # granted, then cancelled before it resumed: hand the slot on
                self._release(key, None)
            elif waiter.queued:
                self._unqueue(waiter)
            self._forget_if_idle(key)
            raise

    def _unqueue(self, waiter: _Waiter) -> None:
        queue = self._waiting[waiter.key]
        queue.remove(waiter)
        if not queue:
            del self._waiting[waiter.key]
        waiter.queued = False
        self._set_depth(self._depth - 1)

    def _release(self, key: str, service_s: float | None) -> None:
        self._in_flight -= 1
        held = self._per_key[key] - 1
        if held:
            self._per_key[key] = held
            self._metrics.key_in_flight.labels(key).set(held)
        else:
            del self._per_key[key]
            self._metrics.key_in_flight.remove(key)  # idle keys leave no series behind
        self._metrics.in_flight.set(self._in_flight)
        if service_s is not None:
            previous = self._service_s
            self._service_s = service_s if previous is None else previous + SERVICE_EWMA_ALPHA * (service_s - previous)
        self._dispatch()
        self._forget_if_idle(key)

    def _dispatch(self) -> None:
        """Hand free slots to waiters, least recently granted eligible key first."""
        while self._in_flight < self.max_concurrent:
            ready = [k for k in self._waiting if self._per_key.get(k, 0) < self.concurrency(k)]
            if not ready:
                return
            key = min(ready, key=lambda k: self._last_grant.get(k, 0))  # min keeps dict order on ties
            waiter = self._waiting[key][0]
            self._unqueue(waiter)
            if waiter.future.cancelled():  # cancelled, its task not yet resumed: it only needs forgetting
                continue
            waiter.granted = True
            self._grant(key)
            waiter.future.set_result(None)

    def _forget_if_idle(self, key: str) -> None:
        if key not in self._per_key and key not in self._waiting:
            self._last_grant.pop(key, None)

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        self._metrics.depth.set(depth)

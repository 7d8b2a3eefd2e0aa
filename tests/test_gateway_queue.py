"""FairQueue: round-robin fairness, exact limits, queue-full rejection, cancellation, metrics.

Every scenario runs on one event loop and advances by yielding (asyncio.sleep(0)) until a stated condition
holds; time comes from an injected clock, never the wall clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from runtime.gateway.fair_queue import DEFAULT_SERVICE_S, RETRY_AFTER_MAX_S, FairQueue, KeyLimits, QueueFull


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


async def until(condition: Callable[[], bool], steps: int = 2000) -> None:
    """Yield to the loop until `condition` holds; fail (not hang) if it never does."""
    for _ in range(steps):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


@dataclass
class Harness:
    """Requests that hold their slot until the test releases them by name; records start order and peaks."""

    enter: Callable[[str], AbstractAsyncContextManager[float]]
    started: list[str] = field(default_factory=list)
    waits: dict[str, float] = field(default_factory=dict)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    holding: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)

    def submit(self, key: str, name: str) -> asyncio.Task[None]:
        self.gates[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(self._request(key, name))
        return self.tasks[name]

    async def _request(self, key: str, name: str) -> None:
        async with self.enter(key) as waited:
            self.started.append(name)
            self.waits[name] = waited
            for k in (key, "*"):
                self.holding[k] = self.holding.get(k, 0) + 1
                self.peak[k] = max(self.peak.get(k, 0), self.holding[k])
            try:
                await self.gates[name].wait()
            finally:
                for k in (key, "*"):
                    self.holding[k] -= 1

    async def finish(self, name: str) -> None:
        assert name in self.started, f"{name} never started"
        self.gates[name].set()
        await self.tasks[name]

    async def drain(self, total: int) -> None:
        """Release requests in the order they start until `total` have run."""
        for i in range(total):
            await until(lambda i=i: len(self.started) > i)
            await self.finish(self.started[i])


async def refused(q: FairQueue, key: str) -> QueueFull:
    """The QueueFull one request for `key` meets; fails (rather than hangs) if it is queued instead."""

    async def attempt() -> None:
        async with q.slot(key):
            raise AssertionError("admitted past a full queue")

    task = asyncio.create_task(attempt())
    try:
        await until(task.done, steps=50)
    finally:
        task.cancel()
    error = task.exception()
    assert isinstance(error, QueueFull), error
    return error


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


async def flood_then_one(enter: Callable[[str], AbstractAsyncContextManager[float]], concurrency: int) -> list[str]:
    """Tenant A queues 100 requests, then B sends 1; returns the order requests started in."""
    h = Harness(enter)
    for i in range(100):
        h.submit("a", f"A{i}")
    await until(lambda: len(h.started) == concurrency)
    h.submit("b", "B0")
    await h.drain(101)
    return h.started


@pytest.mark.parametrize("concurrency", [1, 4])
def test_one_request_of_a_second_key_starts_after_one_completion_of_a_flooding_key(concurrency: int) -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=200, max_concurrent=concurrency, per_key_concurrency=concurrency)
        order = await flood_then_one(q.slot, concurrency)
        # concurrency A's were already running; B takes the slot the first of them frees.
        assert order.index("B0") == concurrency
        assert order == [f"A{i}" for i in range(concurrency)] + ["B0"] + [f"A{i}" for i in range(concurrency, 100)]

    run(scenario)


def test_fairness_check_catches_a_fifo_queue() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=200, max_concurrent=1, per_key_concurrency=1)
        order = await flood_then_one(lambda _key: q.slot("everyone"), 1)  # one key: plain FIFO
        assert order.index("B0") == 100

    run(scenario)


def test_two_backlogged_keys_alternate() -> None:
    async def scenario() -> None:
        h = Harness(FairQueue(max_queued=20, max_concurrent=1, per_key_concurrency=1).slot)
        for i in range(5):
            h.submit("a", f"A{i}")
        for i in range(5):
            h.submit("b", f"B{i}")
        await h.drain(10)
        assert h.started == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3", "A4", "B4"]

    run(scenario)


def test_per_key_and_global_limits_are_exact() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=10, max_concurrent=3, per_key_concurrency=2)
        h = Harness(q.slot)
        for i in range(3):
            h.submit("a", f"A{i}")
        for i in range(3):
            h.submit("b", f"B{i}")
        await until(lambda: q.depth == 3)
        assert h.started == ["A0", "A1", "B0"]
        assert (q.in_flight, q.per_key_in_flight) == (3, {"a": 2, "b": 1})
        await h.drain(6)
        assert h.peak == {"*": 3, "a": 2, "b": 2}
        assert (q.in_flight, q.depth, q.per_key_in_flight) == (0, 0, {})

    run(scenario)


def test_per_key_limit_holds_back_a_key_while_global_slots_are_free() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=10, max_concurrent=8, per_key_concurrency=2)
        h = Harness(q.slot)
        for i in range(4):
            h.submit("a", f"A{i}")
        await until(lambda: q.depth == 2)
        assert (q.in_flight, h.started) == (2, ["A0", "A1"])
        h.submit("b", "B0")  # free global slot, b under its limit: starts at once, ahead of a's queue
        await until(lambda: "B0" in h.started)
        assert (q.in_flight, q.depth) == (3, 2)
        await h.drain(5)

    run(scenario)


def test_a_keys_own_limits_replace_the_defaults_and_bound_its_queue() -> None:
    """A tenant's limits (runtime.gateway.tenants): "small" may hold 1 slot and queue 1 request; "big" has
    the defaults (3 slots, queued up to the global bound)."""

    async def scenario() -> None:
        q = FairQueue(max_queued=10, max_concurrent=8, per_key_concurrency=3, key_limits={"small": KeyLimits(1, 1)})
        h = Harness(q.slot)
        h.submit("small", "S0")
        h.submit("small", "S1")
        await until(lambda: q.depth == 1)
        assert h.started == ["S0"] and q.concurrency("small") == 1
        await refused(q, "small")  # its one queue place is taken, though the queue and the slots have room
        for i in range(5):
            h.submit("big", f"B{i}")
        await until(lambda: q.depth == 3)
        assert (h.started, q.per_key_in_flight) == (["S0", "B0", "B1", "B2"], {"small": 1, "big": 3})
        await h.finish("S0")
        await until(lambda: "S1" in h.started)
        h.submit("small", "S2")  # queued, not refused: S1 left the queue
        await until(lambda: q.depth == 3)
        await h.drain(len(h.tasks))
        assert h.peak["small"] == 1 and h.peak["big"] == 3

    run(scenario)


def test_bad_key_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_concurrent"):
        KeyLimits(0)
    with pytest.raises(ValueError, match="max_queued"):
        KeyLimits(1, -1)


def test_queue_full_rejects_at_exactly_max_queued() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=2, max_concurrent=1, per_key_concurrency=1)
        h = Harness(q.slot)
        for i in range(3):
            h.submit("a", f"A{i}")
        await until(lambda: q.depth == 2)
        error = await refused(q, "b")
        # No completion yet: DEFAULT_SERVICE_S per request, (2 waiting + the retry) through 1 slot.
        assert error.retry_after_s == pytest.approx(3 * DEFAULT_SERVICE_S)
        assert (error.key, error.depth) == ("b", 2)
        assert (q.depth, q.in_flight) == (2, 1)  # the refusal changed nothing
        await h.finish("A0")
        await until(lambda: q.depth == 1)
        h.submit("b", "B0")  # one below max_queued again: queued, not refused
        await until(lambda: q.depth == 2)
        await h.drain(4)
        assert h.started == ["A0", "A1", "B0", "A2"]

    run(scenario)


def test_a_tenant_over_its_own_queue_bound_is_told_when_its_own_backlog_drains() -> None:
    """A key refused for its own max_queued: Retry-After from its waiters and the slots it holds, not the whole
    queue's (here 3 of its own ahead through its 2 slots, while 9 wait for the 8 slots in all)."""

    async def scenario() -> None:
        q = FairQueue(max_queued=100, max_concurrent=8, per_key_concurrency=2, key_limits={"t": KeyLimits(2, 3)})
        h = Harness(q.slot)
        for i in range(5):
            h.submit("t", f"T{i}")
        for key in "abcd":
            for i in range(3):
                h.submit(key, f"{key}{i}")
        await until(lambda: q.depth == 3 + 1 + 1 + 1 + 3)  # a, b, c hold 2 slots each; d none
        error = await refused(q, "t")
        assert (error.key, error.depth) == ("t", 3)
        assert error.retry_after_s == pytest.approx(DEFAULT_SERVICE_S * (3 + 1) / 2)
        assert "your tenant's request queue is full (3 waiting)" in str(error)
        assert q.retry_after_s == pytest.approx(DEFAULT_SERVICE_S * (9 + 1) / 8)  # the global estimate differs
        await h.drain(len(h.tasks))

    run(scenario)


def test_zero_max_queued_refuses_whenever_no_slot_is_free() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=0, max_concurrent=1, per_key_concurrency=1, clock=FakeClock())
        async with q.slot("a"):
            await refused(q, "b")
        async with q.slot("b") as waited:
            assert waited == 0.0

    run(scenario)


def test_can_start_says_whether_a_slot_is_granted_without_waiting() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=4, max_concurrent=2, per_key_concurrency=1, clock=FakeClock())
        h = Harness(q.slot)
        assert q.can_start("a")
        h.submit("a", "A0")
        await until(lambda: h.started == ["A0"])
        assert not q.can_start("a") and q.can_start("b")  # a's own limit; b still fits
        h.submit("a", "A1")  # queued behind A0
        h.submit("b", "B0")
        await until(lambda: h.started == ["A0", "B0"])
        assert not q.can_start("c") and q.depth == 1  # the global limit
        await h.finish("A0")  # A1 takes the freed slot: still nothing for c
        await until(lambda: h.started == ["A0", "B0", "A1"])
        assert not q.can_start("c")
        await h.drain(3)
        assert q.can_start("c") and q.in_flight == 0

    run(scenario)


def test_retry_after_follows_recent_service_times() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        q = FairQueue(max_queued=4, max_concurrent=2, per_key_concurrency=2, clock=clock)
        async with q.slot("a"):
            clock.now += 2.0
        assert q.retry_after_s == pytest.approx(2.0 * 1 / 2)  # EWMA seeded with the first service time
        async with q.slot("a"):
            pass  # 0 s: the average moves a fifth of the way
        assert q.retry_after_s == pytest.approx(1.6 / 2)
        async with q.slot("a"):
            clock.now += 1000.0
        assert q.retry_after_s == RETRY_AFTER_MAX_S

    run(scenario)


def test_cancelled_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=10, max_concurrent=1, per_key_concurrency=1)
        h = Harness(q.slot)
        h.submit("a", "A0")
        h.submit("b", "B0")
        h.submit("c", "C0")
        await until(lambda: q.depth == 2)
        h.tasks["B0"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await h.tasks["B0"]
        assert (q.depth, q.in_flight) == (1, 1)
        await h.finish("A0")
        await until(lambda: h.started == ["A0", "C0"])
        await h.finish("C0")
        assert (q.depth, q.in_flight, q.per_key_in_flight) == (0, 0, {})

    run(scenario)


def test_waiter_cancelled_just_before_a_release_does_not_swallow_the_wake_up() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=10, max_concurrent=1, per_key_concurrency=1)
        h = Harness(q.slot)
        b = h.submit("b", "B0")
        c = h.submit("c", "C0")
        async with q.slot("a"):
            await until(lambda: q.depth == 2)
            b.cancel()  # B0's future is cancelled, but its task has not run yet: still in the queue
        # The release above ran in the same step: the slot must go to C0, not to the dead B0.
        await until(lambda: h.started == ["C0"])
        assert b.cancelled()
        await h.finish("C0")
        assert not c.cancelled()
        assert (q.depth, q.in_flight, q.per_key_in_flight) == (0, 0, {})

    run(scenario)


def test_waiter_cancelled_after_its_grant_hands_the_slot_on() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=10, max_concurrent=1, per_key_concurrency=1, clock=FakeClock())
        h = Harness(q.slot)
        b = h.submit("b", "B0")
        async with q.slot("a"):
            await until(lambda: q.depth == 1)
        assert q.per_key_in_flight == {"b": 1}  # granted on release, before B0 resumed
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        assert h.started == []
        assert (q.depth, q.in_flight, q.per_key_in_flight) == (0, 0, {})
        async with q.slot("c") as waited:
            assert waited == 0.0

    run(scenario)


def test_cancelled_or_failing_holder_releases_its_slot() -> None:
    async def scenario() -> None:
        q = FairQueue(max_queued=10, max_concurrent=1, per_key_concurrency=1)
        h = Harness(q.slot)
        a = h.submit("a", "A0")
        h.submit("b", "B0")
        await until(lambda: q.depth == 1)
        a.cancel()
        await until(lambda: h.started == ["A0", "B0"])
        assert a.cancelled()
        await h.finish("B0")
        with pytest.raises(RuntimeError):
            async with q.slot("c"):
                raise RuntimeError("upstream failed")
        assert (q.depth, q.in_flight, q.per_key_in_flight) == (0, 0, {})

    run(scenario)


def test_metrics_after_a_scenario() -> None:
    async def scenario() -> None:
        registry = CollectorRegistry()
        clock = FakeClock()
        q = FairQueue(max_queued=1, max_concurrent=1, per_key_concurrency=1, registry=registry, clock=clock)

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        h = Harness(q.slot)
        h.submit("a", "A0")
        h.submit("a", "A1")
        await until(lambda: q.depth == 1)
        assert (value("trtserve_gateway_queue_depth"), value("trtserve_gateway_in_flight")) == (1.0, 1.0)
        for key in ("a", "b"):
            await refused(q, key)
        clock.now = 1.5
        await h.finish("A0")
        await until(lambda: h.started == ["A0", "A1"])
        assert h.waits == {"A0": 0.0, "A1": 1.5}
        assert value("trtserve_gateway_queue_depth") == 0.0
        assert value("trtserve_gateway_key_in_flight", key="a") == 1.0
        assert value("trtserve_gateway_queue_rejections_total", key="a") == 1.0
        assert value("trtserve_gateway_queue_rejections_total", key="b") == 1.0
        assert value("trtserve_gateway_queue_wait_seconds_count") == 2.0
        assert value("trtserve_gateway_queue_wait_seconds_sum") == 1.5
        assert value("trtserve_gateway_queue_wait_seconds_bucket", le="1.0") == 1.0
        assert value("trtserve_gateway_queue_wait_seconds_bucket", le="2.5") == 2.0
        await h.finish("A1")
        assert value("trtserve_gateway_in_flight") == 0.0
        assert value("trtserve_gateway_key_in_flight", key="a") is None  # idle keys leave no series

    run(scenario)


@pytest.mark.parametrize(
    ("args", "field_name"),
    [((-1, 1, 1), "max_queued"), ((0, 0, 1), "max_concurrent"), ((0, 1, 0), "per_key_concurrency")],
)
def test_bad_limits_are_refused(args: tuple[int, int, int], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        FairQueue(*args)

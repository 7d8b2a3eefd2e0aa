"""Replica choice without servers: prompt-prefix hashing, the per-replica LRU index, each policy's pick
(prefix match, fallback to least loaded past the balance thresholds, KV limit, health), the replica
config and its errors, load scrapes, DNS discovery, retries before the first token, and the vLLM-named
engine metrics. Time comes from an injected clock; replicas' health and load are set directly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from runtime.gateway.errors import GatewayError
from runtime.gateway.exchange import Exchange
from runtime.gateway.fair_queue import FairQueue
from runtime.gateway.health import Monitor, parse_engine_load, resolve
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.prefix_index import PrefixIndex, chunk_hashes, prompt_text
from runtime.gateway.replica_config import Discovery, Replica, RoutingSettings, routing_from
from runtime.gateway.replicas import (
    IMBALANCE,
    LEAST_LOADED,
    NO_PREFIX_MATCH,
    PREFIX_MATCH,
    ROUND_ROBIN,
    EngineLoad,
    ReplicaPool,
)
from runtime.gateway.routing import EXPLICIT, Backend, GatewayConfig, RouteDecision, Router
from runtime.gateway.wire import Delta, GenerateRequest
from tests.gateway_helpers import stream_exchange

A, B, C = "10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"
SYSTEM = "You are a careful assistant. " * 20  # 580 characters: 9 chunks of 64 with its role


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def pool(policy: str = "prefix", urls: tuple[str, ...] = (A, B, C), clock: Clock | None = None,
         standby: tuple[str, ...] = (), **settings: object) -> ReplicaPool:  # fmt: skip
    """A pool whose replicas (`standby` among them marked so) are all healthy (set directly: nothing is probed)."""
    routing = RoutingSettings(policy=policy, **settings)  # type: ignore[arg-type]
    made = ReplicaPool("m", "llm", [Replica(u, standby=u in standby) for u in urls], routing, policy,  # type: ignore[arg-type]
                       GatewayMetrics.create(CollectorRegistry()), clock or Clock())  # fmt: skip
    for replica in made.replicas.values():
        replica.upstream.healthy = True
    return made


def chat(system: str, user: str) -> GenerateRequest:
    return GenerateRequest(None, [{"role": "system", "content": system}, {"role": "user", "content": user}], {})


OPEN_LEASES: list[object] = []  # referenced, so that no lease closes (its request ends) when collected


def route(p: ReplicaPool, request: GenerateRequest) -> tuple[str, str]:
    """Pick a replica for `request` and open a request there (left open: it counts as load)."""
    hashes = p.prefix_key(request)
    pick = p.pick(hashes)
    lease = p.lease(pick, hashes)
    lease.__enter__()
    OPEN_LEASES.append(lease)
    return pick.replica.url, pick.reason


# --- hashing and the index ---


def test_only_full_chunks_are_hashed_up_to_the_cap():
    assert len(chunk_hashes("x" * 127, 64, 10)) == 1
    assert len(chunk_hashes("x" * 128, 64, 10)) == 2
    assert len(chunk_hashes("x" * 6400, 64, 10)) == 10
    assert chunk_hashes("x" * 63, 64, 10) == []


def test_hashes_are_chained_so_equal_hashes_mean_equal_prefixes():
    head_a, head_b, tail = "a" * 64, "b" * 64, "t" * 64
    a, b = chunk_hashes(head_a + tail, 64, 8), chunk_hashes(head_b + tail, 64, 8)
    assert a[1] != b[1]  # the same chunk text after different heads: different hashes (an unchained hash fails)
    assert chunk_hashes(head_a + tail + "more" * 40, 64, 8)[:2] == a  # a longer prompt extends, never changes


def test_chat_messages_sharing_a_head_share_its_chunks():
    first, second = chat(SYSTEM, "What is paged attention? " * 8), chat(SYSTEM, "Explain prefix caching. " * 8)
    h1, h2 = (chunk_hashes(prompt_text(r), 64, 64) for r in (first, second))
    shared = len(prompt_text(first).split("\x1e")[0]) // 64  # chunks inside the system message
    assert h1[:shared] == h2[:shared] and shared == 9
    assert len(h1) == len(h2) > shared and not set(h1[shared:]) & set(h2[shared:])
    assert chunk_hashes(prompt_text(chat("Different. " + SYSTEM, "What is paged attention? " * 8)), 64, 64)[0] != h1[0]
    assert prompt_text(GenerateRequest("raw text", None, {})) == "raw text"


def test_index_matches_leading_chunks_only():
    index = PrefixIndex(100)
    hashes = chunk_hashes(SYSTEM, 64, 64)
    index.insert(hashes[:5])
    assert index.match(hashes) == 5
    assert index.match(chunk_hashes("Z" + SYSTEM, 64, 64)) == 0  # same text from the second character on
    assert index.match([]) == 0


def test_index_is_bounded_and_evicts_tails_and_old_prompts_first():
    index = PrefixIndex(6)
    old, new = chunk_hashes("o" * 256, 64, 8), chunk_hashes("n" * 256, 64, 8)
    index.insert(old)
    index.insert(new)
    assert len(index) == 6
    assert (index.match(new), index.match(old)) == (4, 2)  # the old prompt keeps its head, not its tail
    index.insert(old[:2])  # its head routed again: most recent now
    index.insert(chunk_hashes("z" * 64, 64, 8))
    assert (index.match(old), index.match(new)) == (2, 3)
    index.clear()
    assert len(index) == 0 and index.match(new) == 0


# --- picks ---


def test_round_robin_cycles_over_healthy_replicas():
    p = pool("round_robin")
    assert [route(p, chat(SYSTEM, "q"))[0] for _ in range(4)] == [A, B, C, A]
    p.replicas[B].upstream.healthy = False
    picks = [route(p, chat(SYSTEM, "q")) for _ in range(2)]
    assert {url for url, _ in picks} == {A, C} and {reason for _, reason in picks} == {ROUND_ROBIN}


def test_least_loaded_counts_open_requests_and_fresh_scrapes_only():
    clock = Clock()
    p = pool("least_loaded", clock=clock, metrics_interval_s=1.0)
    p.replicas[A].in_flight = 2
    p.record_engine(p.replicas[B], EngineLoad(waiting=2, running=1, kv_usage=0.1, at=clock.now))
    p.record_engine(p.replicas[C], EngineLoad(waiting=0, running=2, kv_usage=0.5, at=clock.now))
    assert [p.load(p.replicas[u]) for u in (A, B, C)] == [2, 3, 2]
    assert route(p, chat("x", "y")) == (A, LEAST_LOADED)  # A and C tie on load; A has less KV in use
    clock.now += 3.0  # three intervals: still fresh
    assert p.load(p.replicas[B]) == 3
    clock.now += 0.01  # stale: only the gateway's own count is left
    assert [p.load(p.replicas[u]) for u in (A, B, C)] == [3, 0, 0]


def test_new_prefixes_spread_and_a_known_prefix_follows_its_replica():
    p = pool("prefix")
    firsts = [route(p, chat(f"{i} " + SYSTEM, "q")) for i in range(3)]
    assert sorted(url for url, _ in firsts) == [A, B, C] and {r for _, r in firsts} == {NO_PREFIX_MATCH}
    for replica in p.replicas.values():
        replica.in_flight = 0
    for i in range(3):
        assert route(p, chat(f"{i} " + SYSTEM, "another question")) == (firsts[i][0], PREFIX_MATCH)


def test_the_longest_match_wins_and_ties_go_to_the_less_loaded():
    p = pool("prefix")
    hashes = p.prefix_key(chat(SYSTEM, "q"))
    p.replicas[A].index.insert(hashes[:3])
    p.replicas[B].index.insert(hashes[:6])
    assert p.pick(hashes).replica.url == B and p.pick(hashes).matched_chunks == 6
    p.replicas[A].index.insert(hashes[:6])
    p.replicas[B].in_flight = 1
    assert (p.pick(hashes).replica.url, p.pick(hashes).reason) == (A, PREFIX_MATCH)


@pytest.mark.parametrize(
    ("best_load", "least_load", "expected"),
    [(7, 0, PREFIX_MATCH), (8, 0, IMBALANCE), (11, 4, PREFIX_MATCH), (12, 4, IMBALANCE), (13, 9, PREFIX_MATCH)],
)
def test_prefix_falls_back_to_least_loaded_past_both_thresholds(best_load, least_load, expected):
    """balance_abs 8, balance_rel 1.5: 11 vs 4 is 7 apart (stays); 12 vs 4 is 8 apart and 3x (moves);
    13 vs 9 is 4 apart (stays)."""
    p = pool("prefix", urls=(A, B), balance_abs=8, balance_rel=1.5)
    hashes = p.prefix_key(chat(SYSTEM, "q"))
    p.replicas[A].index.insert(hashes)
    p.replicas[A].in_flight, p.replicas[B].in_flight = best_load, least_load
    pick = p.pick(hashes)
    assert (pick.replica.url, pick.reason) == ((A if expected == PREFIX_MATCH else B), expected)


def test_the_relative_threshold_alone_keeps_the_match():
    p = pool("prefix", urls=(A, B), balance_abs=2, balance_rel=2.0)
    hashes = p.prefix_key(chat(SYSTEM, "q"))
    p.replicas[A].index.insert(hashes)
    p.replicas[A].in_flight, p.replicas[B].in_flight = 9, 5  # 4 apart, but less than twice
    assert p.pick(hashes).reason == PREFIX_MATCH
    p.replicas[A].in_flight = 10
    assert p.pick(hashes).reason == IMBALANCE


def test_replicas_sharing_a_kv_tier_give_a_match_up_to_any_less_loaded_replica():
    p = pool("prefix", urls=(A, B), shared_kv_tier=True)
    hashes = p.prefix_key(chat(SYSTEM, "q"))
    p.replicas[A].index.insert(hashes)
    p.replicas[A].in_flight, p.replicas[B].in_flight = 3, 3
    assert p.pick(hashes).reason == PREFIX_MATCH  # equal load: locality still wins
    p.replicas[A].in_flight = 4
    assert (p.pick(hashes).replica.url, p.pick(hashes).reason) == (B, IMBALANCE)  # B reads it from the tier
    with pytest.raises(ValueError, match="shared_kv_tier: expected true or false"):
        routing_from("routing", {"shared_kv_tier": "yes"})


def test_a_full_kv_cache_is_passed_over_while_another_has_room():
    clock = Clock()
    p = pool("prefix", urls=(A, B), clock=clock, kv_usage_limit=0.9)
    hashes = p.prefix_key(chat(SYSTEM, "q"))
    p.replicas[A].index.insert(hashes)
    p.record_engine(p.replicas[A], EngineLoad(0, 1, kv_usage=0.9, at=clock.now))
    p.record_engine(p.replicas[B], EngineLoad(0, 1, kv_usage=0.2, at=clock.now))
    assert (p.pick(hashes).replica.url, p.pick(hashes).reason) == (B, IMBALANCE)
    p.record_engine(p.replicas[B], EngineLoad(0, 1, kv_usage=0.95, at=clock.now))  # both full: the match again
    assert (p.pick(hashes).replica.url, p.pick(hashes).reason) == (A, PREFIX_MATCH)


def test_a_replica_that_went_down_is_skipped_and_forgets_its_prefixes():
    p = pool("prefix", urls=(A, B))
    request = chat(SYSTEM, "q")
    url, _ = route(p, request)
    other = B if url == A else A
    p.replicas[url].upstream.healthy = False
    assert route(p, request) == (other, NO_PREFIX_MATCH)
    p.replicas[url].upstream.healthy = True  # back (maybe restarted: an empty KV cache)
    assert len(p.replicas[url].index) == 0
    with pytest.raises(GatewayError, match=f"tried: {A}, {B}") as caught:
        p.pick(p.prefix_key(request), frozenset({A, B}))
    assert caught.value.status == 503


@pytest.mark.parametrize("policy", ["prefix", "round_robin", "least_loaded"])
def test_a_standby_is_picked_only_while_no_other_replica_can_serve_and_keeps_what_it_took_over(policy: str):
    p = pool(policy, urls=(A, B), standby=(B,))
    request = chat(SYSTEM, "q")
    for _ in range(4):  # however loaded A gets, and whatever B's index holds
        assert route(p, request)[0] == A
    p.replicas[B].index.insert(p.prefix_key(request))
    assert route(p, request)[0] == A
    assert p.pick(p.prefix_key(request), frozenset({A})).replica.url == B  # A failed this request: the spare
    p.replicas[A].upstream.healthy = False  # A's model died
    assert route(p, request)[0] == B
    p.replicas[A].upstream.healthy = True  # restarted
    assert route(p, request)[0] == B  # the spare serves on: two engines on one machine would thrash
    p.replicas[B].in_flight = 0  # a quiet moment (its requests ended)
    assert route(p, request)[0] == A
    p.replicas[B].upstream.healthy = False
    p.replicas[A].upstream.healthy = False
    with pytest.raises(GatewayError, match="no healthy replica"):
        p.pick([])


def test_round_robin_and_least_loaded_index_nothing():
    for policy in ("round_robin", "least_loaded"):
        p = pool(policy)
        assert p.prefix_key(chat(SYSTEM, "q")) == []


# --- config ---

REPLICAS_YAML = """\
routing: {policy: prefix, chunk_chars: 32, balance_abs: 4, health_interval_s: 0.5}
backends:
  smol:
    replicas:
      - {url: "10.0.0.1:8001", metrics_url: "http://10.0.0.1:8002/metrics"}
      - "10.0.0.2:8001"
      - {url: "127.0.0.1:9001", standby: true}
    routing: least_loaded
  pods:
    discover: {host: trtserve-triton.default.svc.cluster.local}
"""


def test_replicas_and_routing_load_from_yaml(tmp_path: Path):
    path = tmp_path / "gateway.yaml"
    path.write_text(REPLICAS_YAML)
    config = GatewayConfig.load(path)
    assert config.routing == RoutingSettings(chunk_chars=32, balance_abs=4, health_interval_s=0.5)
    assert config.backends["smol"] == Backend(
        "smol",
        replicas=(
            Replica("10.0.0.1:8001", "http://10.0.0.1:8002/metrics"),
            Replica("10.0.0.2:8001"),
            Replica("127.0.0.1:9001", standby=True),
        ),
        routing="least_loaded",
    )
    assert config.backends["pods"].discover == Discovery("trtserve-triton.default.svc.cluster.local", 8001, 8002)
    assert config.backends["pods"].configured_replicas == ()
    assert Backend("one", "h:1").configured_replicas == (Replica("h:1"),)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("backends:\n  a: {url: 'h:1', replicas: ['h:2']}\n", r"backends\.a\.replicas: give one of url, replicas"),
        ("backends:\n  a: {replicas: []}\n", r"backends\.a\.replicas: expected a non-empty list"),
        ("backends:\n  a: {replicas: ['h:1', 'h:1']}\n", r"backends\.a\.replicas\[1\]\.url: 'h:1' is listed twice"),
        ("backends:\n  a: {replicas: ['h']}\n", r"backends\.a\.replicas\[0\]\.url: expected tritonserver's gRPC"),
        ("backends:\n  a: {replicas: [{url: 'h:1', metrics_url: 'h:2/metrics'}]}\n",
         r"backends\.a\.replicas\[0\]\.metrics_url: expected an http"),
        ("backends:\n  a: {replicas: [{url: 'h:1', metric_url: x}]}\n", r"replicas\[0\]\.metric_url: unknown"),
        ("backends:\n  a: {replicas: [{metrics_url: 'http://h/'}]}\n", r"backends\.a\.replicas\[0\]\.url: required"),
        ("backends:\n  a: {replicas: [{url: 'h:1', standby: 'yes'}]}\n", r"replicas\[0\]\.standby: expected true or"),
        ("backends:\n  a: {discover: {host: 'svc:8001'}}\n", r"backends\.a\.discover\.host: expected a DNS name"),
        ("backends:\n  a: {discover: {host: svc, grpc_port: 0}}\n", r"backends\.a\.discover\.grpc_port"),
        ("backends:\n  a: {url: 'h:1', routing: random}\n", r"backends\.a\.routing: expected one of prefix, round"),
        ("routing: {policy: random}\nbackends:\n  a: {url: 'h:1'}\n", r"routing\.policy: expected one of"),
        ("routing: {balance_abs: 0}\nbackends:\n  a: {url: 'h:1'}\n", r"routing\.balance_abs: expected an integer"),
        ("routing: {balance_rel: 0.5}\nbackends:\n  a: {url: 'h:1'}\n", r"routing\.balance_rel: expected a number"),
        ("routing: {kv_usage_limit: 2}\nbackends:\n  a: {url: 'h:1'}\n", r"routing\.kv_usage_limit: expected a frac"),
        ("routing: {chunk_chars: 64.0}\nbackends:\n  a: {url: 'h:1'}\n", r"routing\.chunk_chars: expected an integer"),
        ("routing: {policy: prefix, chunk: 64}\nbackends:\n  a: {url: 'h:1'}\n", r"routing\.chunk: unknown field"),
        ("routing: prefix\nbackends:\n  a: {url: 'h:1'}\n", r"routing: expected a mapping"),
    ],
)  # fmt: skip
def test_bad_replica_configs_name_the_field(tmp_path: Path, text: str, error: str):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        GatewayConfig.load(path)


# --- load scrapes and discovery ---

TRITON_PAGE = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model="llm",version="1"} 3
vllm:num_requests_waiting{model="other",version="1"} 50
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model="llm",version="1"} 2
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model="llm",version="1"} 0.25
# TYPE trtserve_num_requests_waiting gauge
trtserve_num_requests_waiting{model="llm",version="1"} 99
"""


def test_scrapes_read_vllm_names_for_the_served_model():
    assert parse_engine_load(TRITON_PAGE, "llm", 5.0) == EngineLoad(3, 2, 0.25, 5.0)
    older = 'trtserve_num_requests_waiting{model="llm"} 4\ntrtserve_num_requests_running{model="llm"} 1\n'
    assert parse_engine_load(older, "llm", 5.0) == EngineLoad(4, 1, 0.0, 5.0)
    assert parse_engine_load("nv_inference_count 3\n", "llm", 5.0) is None  # no engine gauges: no load


def test_discovery_follows_dns_and_keeps_replicas_when_dns_fails():
    answers: list[list[str] | OSError] = [["10.1.0.1", "10.1.0.2"], ["10.1.0.2", "10.1.0.3"], OSError("NXDOMAIN")]

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    p = pool(urls=())
    removed = []
    monitor = Monitor({"m": p}, {"m": Discovery("svc", 8001, 8002)}, removed.append, resolver)

    async def rounds() -> list[list[str]]:
        seen = []
        for _ in range(3):
            await monitor.rediscover("m")
            seen.append(list(p.replicas))
        return seen

    assert asyncio.run(rounds()) == [["10.1.0.1:8001", "10.1.0.2:8001"], ["10.1.0.2:8001", "10.1.0.3:8001"],
                                     ["10.1.0.2:8001", "10.1.0.3:8001"]]  # fmt: skip
    assert [r.url for r in removed] == ["10.1.0.1:8001"]
    assert p.replicas["10.1.0.3:8001"].replica.metrics_url == "http://10.1.0.3:8002/metrics"
    assert Discovery("svc").replica("fd00::1").url == "[fd00::1]:8001"
    assert "127.0.0.1" in asyncio.run(resolve("localhost", 8001))  # the real resolver (loopback only)


# --- retries ---


@dataclass
class FakeUpstream:
    """Yields `deltas` then raises `error` (if any); records how often it was called."""

    url: str
    deltas: list[Delta] = field(default_factory=list)
    error: GatewayError | None = None
    healthy: bool = True
    calls: int = 0

    async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        self.calls += 1
        for delta in self.deltas:
            yield delta
        if self.error is not None:
            if self.error.status == 503:
                self.healthy = False
            raise self.error


def token(text: str, finish: str | None = None) -> Delta:
    return Delta(text, finish, prompt_tokens=3, completion_tokens=1)


def run_exchange(upstreams: list[FakeUpstream], max_attempts: int = 3) -> tuple[list[str], GatewayError | None]:
    """One streamed generation over replicas in this order (round robin); the texts it got, and its error."""
    p = pool("round_robin", urls=tuple(u.url for u in upstreams), max_attempts=max_attempts)
    for upstream in upstreams:
        p.replicas[upstream.url].upstream = upstream  # type: ignore[assignment]
    config = GatewayConfig({"m": Backend("m", "h:1")})

    result = stream_exchange(
        lambda: Exchange(RouteDecision("m", EXPLICIT), {"m": p}, Router(config), [chat("s", "u")], True, False)
    )
    assert [r.in_flight for r in p.replicas.values()] == [0] * len(upstreams)  # every lease released
    return result


def test_a_replica_failing_before_its_first_token_is_retried_on_the_next():
    down = FakeUpstream(A, error=GatewayError.unavailable("backend 'm' is unreachable"))
    fine = FakeUpstream(B, [token("Hi"), token("!", "stop")])
    assert run_exchange([down, fine]) == (["Hi", "!"], None)
    assert (down.calls, fine.calls) == (1, 1)


def test_a_failure_after_the_first_token_reaches_the_client():
    cut = FakeUpstream(A, [token("Hi")], error=GatewayError.unavailable("backend 'm' is unreachable"))
    spare = FakeUpstream(B, [token("never", "stop")])
    texts, error = run_exchange([cut, spare])
    assert texts == ["Hi"] and error is not None and error.status == 503 and spare.calls == 0


@pytest.mark.parametrize(("status", "retried"), [(400, False), (500, False), (429, True), (502, True), (503, True)])
def test_only_replica_failures_are_retried(status, retried):
    first = FakeUpstream(A, error=GatewayError(status, "failed", "x"))
    second = FakeUpstream(B, [token("ok", "stop")])
    texts, error = run_exchange([first, second])
    assert (texts, error is None, second.calls) == ((["ok"], True, 1) if retried else ([], False, 0))


def test_when_no_replica_is_left_the_last_failure_is_reported():
    overloaded = FakeUpstream(A, error=GatewayError.overloaded("backend 'm' is overloaded"))
    _, error = run_exchange([overloaded])
    assert error is not None and (error.status, error.message) == (429, "backend 'm' is overloaded")
    busy = [FakeUpstream(u, error=GatewayError.overloaded(f"{u} busy")) for u in (A, B, C)]
    _, error = run_exchange(busy, max_attempts=2)  # round robin: A, then the second of B, C
    assert error is not None and error.message == f"{C} busy" and [u.calls for u in busy] == [1, 0, 1]


def test_a_start_granted_at_once_holds_the_queue_slot_until_closed():
    p = pool("round_robin", urls=(A,))
    p.replicas[A].upstream = FakeUpstream(A, [token("Hi"), token("!", "stop")])  # type: ignore[assignment]
    config = GatewayConfig({"m": Backend("m", "h:1")})

    def exchange() -> Exchange:
        return Exchange(RouteDecision("m", EXPLICIT), {"m": p}, Router(config), [chat("s", "u")], True, False)

    async def go() -> list[str]:
        queue = FairQueue(max_queued=4, max_concurrent=1, per_key_concurrency=1)
        first = exchange()
        assert queue.can_start("k")
        slot = queue.slot("k")  # held here: only the exchange's close may release it (not its collection)
        await first.start(slot, immediate=True)
        assert queue.in_flight == 1 and not queue.can_start("k")
        texts = [event.delta.text async for event in first.events()]
        await first.close()
        assert queue.in_flight == 0
        gone = exchange()
        await gone.close()  # the client left before admission: no slot is taken
        with pytest.raises(GatewayError) as caught:
            await gone.start(queue.slot("k"), immediate=True)
        assert caught.value.status == 499 and queue.in_flight == 0
        return texts

    assert asyncio.run(go()) == ["Hi", "!"]


def test_the_admin_api_needs_the_api_key():
    from starlette.requests import Request

    from runtime.gateway.service import Gateway, GatewaySettings

    def request(authorization: str | None) -> Request:
        headers = [(b"authorization", authorization.encode())] if authorization else []
        return Request({"type": "http", "headers": headers})

    config = GatewayConfig.single("m", "h:1")
    keyless = Gateway(config, GatewaySettings())
    keyless.authorize(request(None))  # the OpenAI endpoints stay open without a key...
    with pytest.raises(GatewayError) as caught:
        keyless.authorize(request(None), admin=True)  # ...the admin API does not
    assert (caught.value.status, caught.value.code) == (403, "admin_disabled")
    keyed = Gateway(config, GatewaySettings(api_key="sk-1"))
    keyed.authorize(request("Bearer sk-1"), admin=True)
    for wrong in (None, "Bearer sk-2", "Basic sk-1", "Bearer sk-1x"):
        with pytest.raises(GatewayError) as caught:
            keyed.authorize(request(wrong), admin=True)
        assert caught.value.status == 401


# --- the engine's metrics under vLLM's names ---


class FakeMetric:
    def __init__(self, labels: dict[str, str], buckets: object = None) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value += value


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict[str, str], buckets: object = None) -> FakeMetric:  # pb_utils' spelling
        return FakeMetric(labels, buckets)


class FakePbUtils:
    MetricFamily = FakeFamily


def test_the_model_exports_vllm_names_with_trtserve_values():
    from runtime.engine.stats import EngineStats
    from runtime.triton_model.metrics import TritonMetrics

    metrics = TritonMetrics(FakePbUtils, {"model": "llm", "version": "1"})
    stats = EngineStats(running=2, waiting=5, kv_usage=0.375, kv_blocks={"free": 5, "cached": 0, "used": 3},
                        prefix_cache_queries=120, prefix_cache_hits=96, preemptions=0, prompt_tokens=24,
                        generation_tokens=10, steps=4, finished={}, rejected_overloaded=0,
                        rejected_invalid=0)  # fmt: skip
    metrics.update(stats)
    gauges = {name: m.value for name, m in metrics.gauges.items() if name.startswith("vllm:")}
    counters = {name: m.value for name, m in metrics.counters.items() if name.startswith("vllm:")}
    assert gauges == {"vllm:num_requests_running": 2, "vllm:num_requests_waiting": 5, "vllm:kv_cache_usage_perc": 0.375}
    assert counters == {"vllm:prefix_cache_queries_total": 120, "vllm:prefix_cache_hits_total": 96}

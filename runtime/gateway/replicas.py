"""A backend's replicas and the choice of one per upstream request.

Policies (RoutingSettings.policy, or a backend's `routing`):

- round_robin: healthy replicas in turn.
- least_loaded: the replica with the least load; ties go to the lower KV usage, then rotate.
- prefix (cache-aware, after SGLang's router and llm-d's prefix scorer): each replica keeps a PrefixIndex of
  the prompt-prefix chunks recently routed to it. The replica matching the most leading chunks of the
  prompt wins (ties: the less loaded) while load is balanced; the least loaded replica wins instead when
  nothing matches (new prefixes spread out), or when the match is overloaded: its load exceeds the least
  loaded replica's by `balance_abs` requests and `balance_rel` times, or its KV cache is at
  `kv_usage_limit` while another replica's is below. The chosen replica indexes the prompt's chunks at once,
  so concurrent requests with the same prefix follow it. Replicas that share a KV disk tier (`shared_kv_tier`)
  read each other's prefixes back, so there the match gives way to any less loaded replica.

Load = max(requests this gateway has open to the replica, the engine's running + waiting as last scraped):
the gateway's count is exact and immediate, the scrape adds other clients' work (other gateways, direct
traffic) and is ignored once older than 3 scrape intervals. Unhealthy replicas are never picked; one that
goes down loses its index (it may come back restarted, with an empty KV cache). A standby replica (a warm
spare) is picked only while no other is healthy (or all others were tried); once it has taken over, it keeps
the traffic until it has no request open: a spare shares its replica's machine (`trtserve serve`'s),
where two engines stepping at once thrash the cores (OpenMP teams spinning against each other), so traffic
returns to the restarted replica at a quiet moment, not while the spare still serves. While none is healthy,
`wait_healthy` lets a request wait for one to come back (the monitor's probes find it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Gauge

from runtime.gateway.errors import GatewayError
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.prefix_index import PrefixIndex, chunk_hashes, prompt_text
from runtime.gateway.replica_config import Replica, ReplicaPolicy, RoutingSettings
from runtime.gateway.upstream import Upstream
from runtime.gateway.wire import GenerateRequest

# Pick.reason values (the `reason` label of trtserve_gateway_replica_picks_total).
PREFIX_MATCH = "prefix_match"
NO_PREFIX_MATCH = "no_prefix_match"  # prefix policy, nothing matched: least loaded
IMBALANCE = "imbalance"  # prefix policy, the match was overloaded: least loaded
LEAST_LOADED = "least_loaded"
LORA_RESIDENT = "lora_resident"  # no prefix match: the least loaded replica with the request's adapter in a slot
ROUND_ROBIN = "round_robin"
STALE_AFTER_INTERVALS = 3


@dataclass(frozen=True)
class EngineLoad:
    """A replica's engine gauges from one scrape of its metrics endpoint."""

    waiting: float
    running: float
    kv_usage: float
    at: float  # the pool clock's time of the scrape
    loras: frozenset[str] = frozenset()  # LoRA adapters resident in its engine's slots


class ReplicaState:
    """One replica at run time: its connection, health, open requests, scraped load and prefix index."""

    def __init__(self, backend: str, replica: Replica, triton_model: str, index_chunks: int) -> None:
        self.replica = replica
        self.upstream = Upstream(backend, replica.url, triton_model)
        self.index = PrefixIndex(index_chunks)
        self.in_flight = 0
        self.engine: EngineLoad | None = None
        self.idle = asyncio.Event()  # set while no request is open (a removed replica closes then)
        self.idle.set()
        self._was_healthy = False

    @property
    def url(self) -> str:
        return self.replica.url

    def sync_health(self) -> bool:
        """The upstream's health (kept by probes and failed calls); forgets the index when it went down."""
        healthy = self.upstream.healthy
        if self._was_healthy and not healthy:
            self.index.clear()
        self._was_healthy = healthy
        return healthy


@dataclass(frozen=True)
class Pick:
    replica: ReplicaState
    reason: str
    matched_chunks: int  # leading prompt chunks found in the picked replica's index


class ReplicaPool:
    """The replicas of one backend; `pick` chooses, `lease` holds the choice for one upstream request."""

    def __init__(self, name: str, triton_model: str, replicas: Sequence[Replica], settings: RoutingSettings,
                 policy: ReplicaPolicy, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.name, self.triton_model = name, triton_model
        self.settings, self.policy, self.metrics = settings, policy, metrics
        self.clock = clock
        self.replicas: dict[str, ReplicaState] = {}  # by gRPC address, in the order added
        self._turn = 0  # round-robin position; also rotates ties between equally loaded replicas
        # Each replica's in-flight and index-size gauges, looked up once (labels() costs microseconds per call,
        # and every request sets both twice); dropped with the replica, whose series forget_replica removes.
        self._gauges: dict[str, tuple[Gauge, Gauge]] = {}
        self.ever_healthy = False  # a replica has been seen serving: none healthy now means a restart
        self._recovery: set[asyncio.Future[None]] = set()  # wait_healthy's waiters, woken by publish_health
        for replica in replicas:
            self.add(replica)

    def add(self, replica: Replica) -> ReplicaState:
        """A new replica (not healthy until probed); ValueError if its address is already in the pool."""
        if replica.url in self.replicas:
            raise ValueError(f"backend {self.name!r} already has replica {replica.url!r}")
        state = ReplicaState(self.name, replica, self.triton_model, self.settings.index_chunks)
        self.replicas[replica.url] = state
        labels = (self.name, replica.url)
        self._gauges[replica.url] = (self.metrics.replica_in_flight.labels(*labels),
                                     self.metrics.replica_index_chunks.labels(*labels))  # fmt: skip
        self._gauges[replica.url][0].set(0)
        self.metrics.replica_healthy.labels(*labels).set(0)
        return state

    def remove(self, url: str) -> ReplicaState:
        """Take a replica out (KeyError if absent): no new requests; open ones finish (close it once `idle`)."""
        state = self.replicas.pop(url)
        del self._gauges[url]
        self.metrics.forget_replica(self.name, url)
        return state

    @property
    def healthy(self) -> list[ReplicaState]:
        replicas = [r for r in self.replicas.values() if r.sync_health()]
        if replicas:
            self.ever_healthy = True
        return replicas

    async def wait_healthy(self, timeout_s: float) -> bool:
        """Whether a replica is healthy within `timeout_s` (at once if one is): woken by publish_health."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.healthy:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            waiter = loop.create_future()
            self._recovery.add(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                self._recovery.discard(waiter)
        return True

    def prefix_key(self, request: GenerateRequest) -> list[bytes]:
        """The request's chunk hashes under its cache salt and LoRA adapter (as the engine keys its blocks): what
        `pick` matches and `lease` indexes (none unless routing by prefix)."""
        if self.policy != "prefix":
            return []
        salt = request.cache_salt if request.lora is None else f"{request.cache_salt or ''}\0lora\0{request.lora}"
        return chunk_hashes(prompt_text(request), self.settings.chunk_chars, self.settings.max_prefix_chunks, salt)

    def load(self, replica: ReplicaState) -> float:
        engine = self._fresh(replica)
        return max(float(replica.in_flight), engine.running + engine.waiting if engine else 0.0)

    def kv_usage(self, replica: ReplicaState) -> float:
        engine = self._fresh(replica)
        return engine.kv_usage if engine else 0.0

    def pick(self, hashes: Sequence[bytes], exclude: frozenset[str] = frozenset(), lora: str | None = None) -> Pick:
        """A healthy replica not in `exclude` for a prompt with these chunk hashes (and LoRA adapter: without a
        prefix match, a replica that has it in a slot, unless overloaded); a standby only when no other is left,
        or while it has requests open (see the module); 503 if there is none."""
        healthy = [r for r in self.healthy if r.url not in exclude]
        spares = [r for r in healthy if r.replica.standby]
        busy_spares = [r for r in spares if r.in_flight]
        candidates = busy_spares or [r for r in healthy if not r.replica.standby] or spares
        if not candidates:
            tried = f" (tried: {', '.join(sorted(exclude))})" if exclude else ""
            raise GatewayError.unavailable(f"no healthy replica of backend {self.name!r}{tried}")
        turn, self._turn = self._turn, self._turn + 1
        if self.policy == "round_robin":
            return Pick(candidates[turn % len(candidates)], ROUND_ROBIN, 0)
        least = self._least_loaded(candidates, turn)
        holder = self._lora_holder(candidates, least, lora, turn)
        if self.policy == "least_loaded":
            return Pick(least, LEAST_LOADED, 0) if holder is None else Pick(holder, LORA_RESIDENT, 0)
        matched = {r.url: r.index.match(hashes) for r in candidates}
        best = max(candidates, key=lambda r: (matched[r.url], -self.load(r)))  # first listed on ties
        if matched[best.url] == 0:
            return Pick(least, NO_PREFIX_MATCH, 0) if holder is None else Pick(holder, LORA_RESIDENT, 0)
        if self._overloaded(best, least):
            return Pick(least, IMBALANCE, matched[least.url])
        return Pick(best, PREFIX_MATCH, matched[best.url])

    @contextmanager
    def lease(self, pick: Pick, hashes: Sequence[bytes]) -> Iterator[Upstream]:
        """Count one open request on the picked replica (and index its prompt there) until the block ends."""
        replica = pick.replica
        replica.index.insert(hashes)
        replica.in_flight += 1
        replica.idle.clear()
        labels = (self.name, replica.url)
        self.metrics.replica_picks.labels(*labels, pick.reason).inc()
        self._publish(replica)
        try:
            yield replica.upstream
        finally:
            replica.in_flight -= 1
            if replica.in_flight == 0:
                replica.idle.set()
            if self.replicas.get(replica.url) is replica:  # a removed replica's series are gone
                self._publish(replica)

    def record_engine(self, replica: ReplicaState, load: EngineLoad | None) -> None:
        """The monitor's latest scrape (None: it failed; the previous one ages out)."""
        if load is not None:
            replica.engine = load
            for gauge, value in ((self.metrics.replica_waiting, load.waiting),
                                 (self.metrics.replica_running, load.running),
                                 (self.metrics.replica_kv_usage, load.kv_usage)):  # fmt: skip
                gauge.labels(self.name, replica.url).set(value)

    def publish_health(self) -> None:
        for replica in self.replicas.values():
            self.metrics.replica_healthy.labels(self.name, replica.url).set(1 if replica.sync_health() else 0)
            self._publish(replica)
        healthy = bool(self.healthy)
        self.metrics.backend_healthy.labels(self.name).set(1 if healthy else 0)
        if healthy:
            for waiter in self._recovery:
                if not waiter.done():
                    waiter.set_result(None)

    def _publish(self, replica: ReplicaState) -> None:
        in_flight, index_chunks = self._gauges[replica.url]
        in_flight.set(replica.in_flight)
        index_chunks.set(len(replica.index))

    def _fresh(self, replica: ReplicaState) -> EngineLoad | None:
        engine = replica.engine
        max_age = STALE_AFTER_INTERVALS * self.settings.metrics_interval_s
        return engine if engine is not None and self.clock() - engine.at <= max_age else None

    def _least_loaded(self, candidates: list[ReplicaState], turn: int) -> ReplicaState:
        """Least load, then least KV usage; replicas at the KV limit only if all are; ties rotate with `turn`."""
        limit = self.settings.kv_usage_limit
        roomy = [r for r in candidates if self.kv_usage(r) < limit] or candidates
        start = turn % len(roomy)
        rotated = roomy[start:] + roomy[:start]
        return min(rotated, key=lambda r: (self.load(r), self.kv_usage(r)))

    def _lora_holder(
        self, candidates: list[ReplicaState], least: ReplicaState, lora: str | None, turn: int
    ) -> ReplicaState | None:
        """The least loaded candidate with `lora` in a slot (no slot load on its first token), unless the least
        loaded replica has it too or it carries too much more load; None otherwise."""
        if lora is None:
            return None
        holders = [r for r in candidates if (engine := self._fresh(r)) is not None and lora in engine.loras]
        if not holders or least in holders:
            return None
        holder = self._least_loaded(holders, turn)
        return None if self._overloaded(holder, least) else holder

    def _overloaded(self, best: ReplicaState, least: ReplicaState) -> bool:
        limit = self.settings.kv_usage_limit
        if self.kv_usage(best) >= limit > self.kv_usage(least):
            return True
        gap = self.load(best) - self.load(least)
        if self.settings.shared_kv_tier:  # the less loaded replica reads the prefix from the shared tier
            return gap > 0
        return gap >= self.settings.balance_abs and self.load(best) >= self.settings.balance_rel * self.load(least)

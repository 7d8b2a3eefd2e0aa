"""The gateway's shared state: settings, router, admission queue, replica pools, health, auth, accounting."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from starlette.requests import Request

from runtime.gateway.errors import GatewayError
from runtime.gateway.exchange import Exchange
from runtime.gateway.fair_queue import FairQueue
from runtime.gateway.health import Monitor
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.replica_config import Replica, ReplicaPolicy
from runtime.gateway.replicas import ReplicaPool, ReplicaState
from runtime.gateway.responses import Choice
from runtime.gateway.routing import ESCALATED, GatewayConfig, RouteDecision, Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewaySettings:
    api_key: str | None = None  # clients must send "Authorization: Bearer <api_key>"
    max_queued: int = 1024  # waiting for a slot; beyond it: 429
    max_concurrent: int = 256  # requests upstream at once, all tenants
    per_key_concurrency: int = 64  # requests upstream at once, one tenant
    routing: ReplicaPolicy | None = None  # every backend's replica policy (--routing); None: as configured


class Gateway:
    def __init__(self, config: GatewayConfig, settings: GatewaySettings,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.router = Router(config, self.registry)
        self.queue = FairQueue(settings.max_queued, settings.max_concurrent, settings.per_key_concurrency,
                               self.registry)  # fmt: skip
        self.metrics = GatewayMetrics.create(self.registry)
        self.routing = config.routing
        self.pools = {
            b.name: ReplicaPool(b.name, b.triton_model, b.configured_replicas, config.routing,
                                settings.routing or b.routing or config.routing.policy, self.metrics)
            for b in config.backends.values()
        }  # fmt: skip
        discover = {b.name: b.discover for b in config.backends.values() if b.discover is not None}
        self.monitor = Monitor(self.pools, discover, self._retire)
        self.model_ids = config.models  # backends, then virtual models
        self.started = time.time()
        self._closing: dict[asyncio.Task[None], ReplicaState] = {}  # removed replicas awaiting their last request

    async def start(self) -> None:
        await self.monitor.start(self.routing.health_interval_s, self.routing.metrics_interval_s)

    async def stop(self) -> None:
        await self.monitor.stop()
        retired = list(self._closing.values())
        for task in list(self._closing):
            task.cancel()
        for replica in [*retired, *(r for pool in self.pools.values() for r in pool.replicas.values())]:
            await replica.upstream.close()

    async def check_health(self, decision: RouteDecision) -> None:
        """503 unless a replica of the decision's backend answers (all probed again now if none did)."""
        pool = self.pools[decision.model]
        if not pool.healthy:
            await asyncio.gather(*(r.upstream.probe() for r in pool.replicas.values()))
            pool.publish_health()
            if not pool.healthy:
                raise GatewayError.unavailable(f"no healthy backend for model {decision.model!r} "
                                               f"(none of its {len(pool.replicas)} replicas is ready)")  # fmt: skip

    async def add_replica(self, backend: str, replica: Replica) -> ReplicaState:
        """Serve `backend` from one more replica too (probed now: it takes traffic once ready)."""
        pool = self.pools[backend]
        state = pool.add(replica)
        await state.upstream.probe()
        pool.publish_health()
        return state

    def remove_replica(self, backend: str, url: str) -> ReplicaState:
        """Stop sending `backend` requests to a replica; requests open there finish first."""
        state = self.pools[backend].remove(url)
        self.pools[backend].publish_health()
        self._retire(state)
        return state

    def _retire(self, state: ReplicaState) -> None:
        async def close_when_idle() -> None:
            await state.idle.wait()
            await state.upstream.close()

        task = asyncio.create_task(close_when_idle())
        self._closing[task] = state
        task.add_done_callback(lambda done: self._closing.pop(done, None))

    def authorize(self, request: Request, admin: bool = False) -> None:
        """401 unless the request carries the API key; `admin` endpoints are refused (403) without one set:
        they change where traffic goes."""
        expected = self.settings.api_key
        if expected is None:
            if admin:
                raise GatewayError(403, "the admin API needs the gateway started with an API key",
                                   "permission_error", code="admin_disabled")  # fmt: skip
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
            raise GatewayError(401, "Incorrect API key provided", "invalid_request_error", code="invalid_api_key")

    def tenant(self, request: Request, user: str | None) -> str:
        """The fairness key: OpenAI's `user` (the end user a client names), else the API key (as a digest:
        keys become metric labels), else the client's address."""
        if user:
            return f"user:{user}"
        if self.settings.api_key is not None:
            return "key:" + hashlib.sha256(self.settings.api_key.encode()).hexdigest()[:12]
        return f"addr:{request.client.host if request.client else 'unknown'}"

    def cache_salt(self, client_salt: str | None) -> str | None:
        return tenant_cache_salt(self.settings.api_key, client_salt)

    def account(self, exchange: Exchange, choices: list[Choice]) -> None:
        """A request answered in full: the router's record and token counters."""
        decision = exchange.decision
        self.router.record(exchange.model, ESCALATED if exchange.escalated else decision.reason, decision.virtual_model)
        self.metrics.tokens.labels(exchange.model, "prompt").inc(sum(c.prompt_tokens for c in choices))
        self.metrics.tokens.labels(exchange.model, "completion").inc(sum(c.completion_tokens for c in choices))
        for kind, count in exchange.discarded_tokens.items():
            if count:
                self.metrics.tokens.labels(decision.model, kind).inc(count)


def tenant_cache_salt(api_key: str | None, client_salt: str | None) -> str | None:
    """The prefix-cache salt sent upstream: the tenant's, from the API key (hashed: the key never leaves
    the gateway), mixed with the client's own `cache_salt`, so a client can split its tenant's cache but
    never pick another tenant's salt. None (the shared cache) without a key or a client salt."""
    if api_key is None and client_salt is None:
        return None
    material = f"trtserve-cache-salt\0{api_key or ''}\0{client_salt or ''}"
    return hashlib.sha256(material.encode()).hexdigest()

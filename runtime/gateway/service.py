"""The gateway's shared state: settings, router, admission queue, replica pools, health, tenants, accounting.

Who a request is for, its limits and its cache salt: runtime.gateway.tenants. Two metric registries: the
public one (/metrics: aggregates, no per-tenant series) and the tenants' (/admin/metrics, admin keys only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from starlette.requests import Request

from runtime.gateway.disagg import DisaggPools
from runtime.gateway.errors import GatewayError, unknown_model
from runtime.gateway.exchange import Exchange
from runtime.gateway.fair_queue import FairQueue, QueueFull
from runtime.gateway.health import Monitor
from runtime.gateway.loras import LoraRegistry
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.replica_config import Replica, ReplicaPolicy
from runtime.gateway.replicas import ReplicaPool, ReplicaState
from runtime.gateway.responses import Choice
from runtime.gateway.responses_api.store import ResponseStore
from runtime.gateway.routing import ESCALATED, GatewayConfig, RouteDecision, Router
from runtime.gateway.tenants import Tenant, find, shorthand, tenant_cache_salt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewaySettings:
    api_key: str | None = None  # the one-tenant shorthand: clients must send "Authorization: Bearer <api_key>"
    max_queued: int = 16384  # waiting for a slot; beyond it: 429 (the seeds' thousands of streams queue)
    max_concurrent: int = 256  # requests upstream at once, all tenants
    per_key_concurrency: int = 64  # requests upstream at once, one tenant
    routing: ReplicaPolicy | None = None  # every backend's replica policy (--routing); None: as configured
    triton_http_url: str | None = None  # tritonserver's HTTP endpoint: the KServe routes' door (triton_http)


class Gateway:
    def __init__(self, config: GatewayConfig, settings: GatewaySettings,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        if config.tenants and settings.api_key:
            raise ValueError("give an API key or a tenants section, not both")
        self.settings = settings
        self.tenants = config.tenants or ((shorthand(settings.api_key),) if settings.api_key else ())
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenant_registry = CollectorRegistry()  # per-tenant series: /admin/metrics, not the public /metrics
        self.router = Router(config, self.registry)
        self.queue = FairQueue(settings.max_queued, settings.max_concurrent, settings.per_key_concurrency,
                               self.registry, key_limits={t.name: t.limits for t in self.tenants},
                               key_registry=self.tenant_registry)  # fmt: skip
        self.metrics = GatewayMetrics.create(self.registry)
        self.routing = config.routing
        self.pools = {
            b.name: ReplicaPool(b.name, b.triton_model, b.configured_replicas, config.routing,
                                settings.routing or b.routing or config.routing.policy, self.metrics)
            for b in config.backends.values()
        }  # fmt: skip
        discover = {b.name: b.discover for b in config.backends.values() if b.discover is not None}
        # Disaggregated backends: a prefill pool (routed as the backend's replicas are) and a decode pool (least
        # loaded), beside the backend's own pool (its `both` workers: the fallback), all watched by the monitor.
        self.disagg: dict[str, DisaggPools] = {}
        for b in config.backends.values():
            if b.prefill is None or b.decode is None:
                continue
            roles = {}
            for role, source, policy in (("prefill", b.prefill, settings.routing or b.routing or config.routing.policy),
                                         ("decode", b.decode, "least_loaded")):  # fmt: skip
                name = f"{b.name}:{role}"
                roles[role] = self.pools[name] = ReplicaPool(name, b.triton_model, source.configured_replicas,
                                                             config.routing, policy, self.metrics)  # fmt: skip
                if source.discover is not None:
                    discover[name] = source.discover
            both = self.pools[b.name] if b.configured_replicas or b.discover is not None else None
            self.disagg[b.name] = DisaggPools(b.name, roles["prefill"], roles["decode"], both)
        self.model_ids = config.models  # backends, then virtual models
        # adapters, named by clients as models, served by every worker of their backend
        workers = {b: [d.prefill, d.decode] for b, d in self.disagg.items()}
        backend_pools = {b: [self.pools[b], *workers.get(b, [])] for b in config.backends}
        self.loras = LoraRegistry(backend_pools, self.model_ids)
        self.monitor = Monitor(self.pools, discover, self._retire, after_health=self.loras.sync)
        self.responses = ResponseStore()  # the Responses API's finished responses (previous_response_id)
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

    def serves(self, model: str) -> bool:
        """Whether a client may name `model` (a backend, virtual model or LoRA adapter), as last known."""
        return model in self.model_ids or self.loras.get(model) is not None

    async def resolve(self, model: str) -> tuple[str, str | None]:
        """(the model to route, the LoRA adapter or None) for the model a client named; 404 if unknown, after
        asking the backends for their adapters (once a second at most)."""
        if model in self.model_ids:
            return model, None
        adapter = self.loras.get(model)
        if adapter is None:
            await self.loras.refresh()
            adapter = self.loras.get(model)
        if adapter is None:
            raise unknown_model(model, [*self.model_ids, *self.loras.adapters])
        return adapter.backend, adapter.name

    async def check_health(self, decision: RouteDecision) -> None:
        """503 unless a replica of the decision's backend answers (all probed again now if none did), or
        it has served before and may wait for one to come back (runtime.gateway.exchange)."""
        disagg = self.disagg.get(decision.model)
        if disagg is not None:  # the prefill and the decode pools must both answer
            for pool in (disagg.prefill, disagg.decode):
                await self._check_pool(pool, decision.model)
            return
        await self._check_pool(self.pools[decision.model], decision.model)

    async def _check_pool(self, pool: ReplicaPool, model: str) -> None:
        if not pool.healthy:
            await asyncio.gather(*(r.upstream.probe() for r in pool.replicas.values()))
            pool.publish_health()
            if not pool.healthy and not (pool.ever_healthy and pool.settings.ready_wait_s > 0):
                raise GatewayError.unavailable(f"no healthy backend for model {model!r} "
                                               f"(none of the {len(pool.replicas)} replicas of {pool.name!r} "
                                               "is ready)")  # fmt: skip

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

    def authorize(self, request: Request, admin: bool = False) -> Tenant | None:
        """The tenant whose key the request carries (None: the gateway has no keys); 401 for a missing or
        unknown key. `admin` endpoints are refused (403) without keys (they change where traffic, and
        prompts, go) and to tenants that are not admins."""
        if not self.tenants:
            if admin:
                raise GatewayError(403, "the admin API needs the gateway started with an API key",
                                   "permission_error", code="admin_disabled")  # fmt: skip
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        tenant = find(self.tenants, given.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise GatewayError(401, "Incorrect API key provided", "invalid_request_error", code="invalid_api_key")
        if admin and not tenant.admin:
            raise GatewayError(403, "this API key may not use the admin API", "permission_error", code="not_admin")
        return tenant

    def queue_key(self, request: Request, tenant: Tenant | None, user: str | None) -> str:
        """The fairness key: the tenant; without tenants, OpenAI's `user` (the end user a client names),
        else the client's address."""
        if tenant is not None:
            return tenant.name
        if user:
            return f"user:{user}"
        return f"addr:{request.client.host if request.client else 'unknown'}"

    async def admit(self, exchange: Exchange, request: Request, tenant: Tenant | None, user: str | None) -> None:
        """Start `exchange` once its fairness key has an admission slot (a 429 when the queue is full)."""
        key = self.queue_key(request, tenant, user)
        try:
            await exchange.start(self.queue.slot(key), immediate=self.queue.can_start(key))
        except QueueFull as exc:
            raise GatewayError.overloaded(str(exc), exc.retry_after_s) from None

    def cache_salt(self, tenant: Tenant | None, client_salt: str | None) -> str | None:
        return tenant_cache_salt(tenant.key if tenant is not None else None, client_salt)

    def account(self, exchange: Exchange, choices: list[Choice]) -> None:
        """A request answered in full: the router's record and token counters."""
        decision = exchange.decision
        self.router.record(exchange.model, ESCALATED if exchange.escalated else decision.reason, decision.virtual_model)
        self.metrics.tokens.labels(exchange.model, "prompt").inc(sum(c.prompt_tokens for c in choices))
        self.metrics.tokens.labels(exchange.model, "completion").inc(sum(c.completion_tokens for c in choices))
        for kind, count in exchange.discarded_tokens.items():
            if count:
                self.metrics.tokens.labels(decision.model, kind).inc(count)

"""The gateway's shared state: settings, router, admission queue, upstreams, health, auth, accounting."""

from __future__ import annotations

import asyncio
import contextlib
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
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.responses import Choice
from runtime.gateway.routing import ESCALATED, GatewayConfig, RouteDecision, Router
from runtime.gateway.upstream import Upstream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewaySettings:
    api_key: str | None = None  # clients must send "Authorization: Bearer <api_key>"
    max_queued: int = 1024  # waiting for a slot; beyond it: 429
    max_concurrent: int = 256  # requests upstream at once, all tenants
    per_key_concurrency: int = 64  # requests upstream at once, one tenant
    health_interval_s: float = 2.0


class Gateway:
    def __init__(self, config: GatewayConfig, settings: GatewaySettings,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.router = Router(config, self.registry)
        self.queue = FairQueue(settings.max_queued, settings.max_concurrent, settings.per_key_concurrency,
                               self.registry)  # fmt: skip
        self.metrics = GatewayMetrics.create(self.registry)
        self.upstreams = {b.name: Upstream(b.name, b.url, b.triton_model) for b in config.backends.values()}
        self.model_ids = config.models  # backends, then virtual models
        self.started = time.time()
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.probe()  # know the backends' state before the first request
        self._health_task = asyncio.create_task(self._watch_health())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for upstream in self.upstreams.values():
            await upstream.close()

    async def probe(self) -> None:
        await asyncio.gather(*(u.probe() for u in self.upstreams.values()))
        for upstream in self.upstreams.values():
            self.metrics.backend_healthy.labels(upstream.name).set(1 if upstream.healthy else 0)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.probe()
            except Exception:  # a probe bug must not end health checking
                log.exception("health probe failed")

    async def check_health(self, decision: RouteDecision) -> None:
        """503 unless the decision's backend answers (probed again now if it was down)."""
        upstream = self.upstreams[decision.model]
        if not upstream.healthy and not await upstream.probe():
            raise GatewayError.unavailable(f"no healthy backend for model {decision.model!r}")

    def authorize(self, request: Request) -> None:
        expected = self.settings.api_key
        if expected is None:
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

    def account(self, exchange: Exchange, choices: list[Choice]) -> None:
        """A request answered in full: the router's record and token counters."""
        decision = exchange.decision
        self.router.record(exchange.model, ESCALATED if exchange.escalated else decision.reason, decision.virtual_model)
        self.metrics.tokens.labels(exchange.model, "prompt").inc(sum(c.prompt_tokens for c in choices))
        self.metrics.tokens.labels(exchange.model, "completion").inc(sum(c.completion_tokens for c in choices))

"""Replica administration over HTTP: list, add and remove a backend's replicas while the gateway runs.

    GET    /admin/replicas                              every backend's policy and replicas, with their state
    POST   /admin/backends/{backend}/replicas           {"url": "host:port", "metrics_url": "http://...",
                                                         "standby": false (true: a warm spare)} -> 201
    DELETE /admin/backends/{backend}/replicas/{url}     open requests there finish; new ones go elsewhere
    GET    /admin/metrics                               the per-tenant series (Prometheus text), kept off /metrics

Authenticated with an admin tenant's key (runtime.gateway.tenants; the --api-key shorthand's is one;
constant-time comparison); refused (403) when the gateway runs without keys, since these endpoints decide
where traffic (and prompts) go, and to other tenants. Changes are not written back to the config file: a
restarted gateway starts from its config again.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import JSONResponse, Response

from runtime.gateway.errors import GatewayError, from_validation
from runtime.gateway.replica_config import Replica, check_replica
from runtime.gateway.replicas import ReplicaPool, ReplicaState
from runtime.gateway.service import Gateway


class NewReplica(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    url: str
    metrics_url: str | None = None
    standby: bool = False


def add_admin_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/admin/metrics")
    async def tenant_metrics(request: Request) -> Response:
        gateway.authorize(request, admin=True)
        return Response(generate_latest(gateway.tenant_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/replicas")
    async def list_replicas(request: Request) -> dict[str, Any]:
        gateway.authorize(request, admin=True)
        return {"backends": {name: _pool(pool) for name, pool in gateway.pools.items()}}

    @app.post("/admin/backends/{backend}/replicas")
    async def add_replica(backend: str, request: Request) -> JSONResponse:
        gateway.authorize(request, admin=True)
        pool = _backend(gateway, backend)
        try:
            body = NewReplica.model_validate(json.loads(await request.body()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise GatewayError.invalid("the body is not valid JSON") from None
        except ValidationError as exc:
            raise from_validation(exc) from None
        replica = Replica(body.url, body.metrics_url, body.standby)
        try:
            check_replica("replica", replica)
        except ValueError as exc:
            raise GatewayError.invalid(str(exc), "url" if ".url:" in str(exc) else "metrics_url") from None
        if replica.url in pool.replicas:
            raise GatewayError(409, f"backend {backend!r} already has replica {replica.url!r}",
                               "invalid_request_error", "url", "replica_exists")  # fmt: skip
        state = await gateway.add_replica(backend, replica)
        return JSONResponse(_replica(pool, state), status_code=201)

    @app.delete("/admin/backends/{backend}/replicas/{url}")
    async def remove_replica(backend: str, url: str, request: Request) -> dict[str, Any]:
        gateway.authorize(request, admin=True)
        pool = _backend(gateway, backend)
        if url not in pool.replicas:
            raise GatewayError(404, f"backend {backend!r} has no replica {url!r}", "invalid_request_error",
                               "url", "replica_not_found")  # fmt: skip
        if len(pool.replicas) == 1:
            raise GatewayError(409, f"{url!r} is the last replica of {backend!r}; add another first",
                               "invalid_request_error", "url", "last_replica")  # fmt: skip
        return _replica(pool, gateway.remove_replica(backend, url))


def _backend(gateway: Gateway, backend: str) -> ReplicaPool:
    if backend not in gateway.pools:
        raise GatewayError(404, f"no backend {backend!r} (backends: {', '.join(gateway.pools)})",
                           "invalid_request_error", "backend", "backend_not_found")  # fmt: skip
    return gateway.pools[backend]


def _pool(pool: ReplicaPool) -> dict[str, Any]:
    return {"policy": pool.policy, "replicas": [_replica(pool, r) for r in pool.replicas.values()]}


def _replica(pool: ReplicaPool, replica: ReplicaState) -> dict[str, Any]:
    return {
        "url": replica.url,
        "metrics_url": replica.replica.metrics_url,
        "standby": replica.replica.standby,
        "healthy": replica.upstream.healthy,
        "in_flight": replica.in_flight,
        "load": pool.load(replica),
        "kv_usage": pool.kv_usage(replica),
        "prefix_index_chunks": len(replica.index),
    }

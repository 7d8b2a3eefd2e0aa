"""LoRA adapters through the gateway: a client names an adapter as its `model`, as with vLLM; the request goes to
the adapter's backend with the adapter in the request contract's `lora` field, and /v1/models lists it with its
backend as `parent`.

Which adapters a backend serves is the backends' own word (their `lora_admin` "list" answer, from `trtserve
serve --lora` and what was loaded since), asked of one healthy replica per backend at most once a second, when a
client names a model the gateway does not know or lists the models. Admin keys load and unload adapters on every
replica of a backend, its prefill and decode workers included when it is disaggregated (vLLM's routes):

    POST /v1/load_lora_adapter    {"lora_name": "...", "lora_path": "/dir", "model": "<backend>"}   (model: optional
                                   with one backend)
    POST /v1/unload_lora_adapter  {"lora_name": "..."}

A load reaches every replica or none (the ones that took it unload it again when another refuses); each replica
keeps it across its own restarts (runtime/triton_model/lora_admin.py), and a replica that joins later (scale-out,
discovery, or one back after being down) is given the adapters loaded here before as the monitor's health round
finds it serving (`sync`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from runtime.gateway.body import read_model
from runtime.gateway.errors import GatewayError
from runtime.gateway.replicas import ReplicaPool, ReplicaState
from runtime.gateway.strict import Strict
from runtime.gateway.wire import GenerateRequest

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 1.0  # the most often the backends are asked for their adapters
LIST = GenerateRequest(None, None, {}, texts={"lora_admin": "list"})
AdapterName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^\S+$")]


@dataclass(frozen=True)
class Adapter:
    name: str
    backend: str
    path: str


class LoraRegistry:
    """Adapter name -> the backend serving it, as the backends last said."""

    def __init__(
        self, pools: dict[str, list[ReplicaPool]], models: list[str], clock: Callable[[], float] = time.monotonic
    ):
        self.pools = pools  # backend -> the pools of its workers (its own; with disaggregation, prefill and decode)
        self.models = models  # the gateway's own names (backends, virtual models): no adapter may take one
        self.clock = clock
        self.adapters: dict[str, Adapter] = {}
        self.loaded: dict[str, Adapter] = {}  # loaded through this gateway: every replica of the backend takes them
        self._synced: weakref.WeakSet[ReplicaState] = weakref.WeakSet()  # healthy replicas known to hold them
        self._asked = -math.inf
        self._lock = asyncio.Lock()

    def get(self, model: str) -> Adapter | None:
        return self.adapters.get(model)

    async def refresh(self, force: bool = False) -> None:
        """Ask each backend's first healthy replica for its adapters (at most once a REFRESH_INTERVAL_S)."""
        async with self._lock:
            if not force and self.clock() - self._asked < REFRESH_INTERVAL_S:
                return
            self._asked = self.clock()
            found: dict[str, Adapter] = {}
            for backend, pools in self.pools.items():
                healthy = [r for pool in pools for r in pool.healthy]
                if not healthy:  # keep what it said before: it is restarting
                    found.update({n: a for n, a in self.adapters.items() if a.backend == backend})
                    continue
                try:
                    served = await _ask(healthy[0], LIST)
                except GatewayError as exc:
                    log.warning("backend %s did not list its LoRA adapters: %s", backend, exc)
                    continue
                for name, path in served.items():
                    if name not in self.models:  # a backend's own name wins
                        found[name] = Adapter(name, backend, path)
            found.update(self.loaded)  # the replica asked may have joined since, not given them yet
            self.adapters = found

    async def sync(self) -> None:
        """Give each replica that serves again or joined since the last call the adapters loaded here (the
        monitor calls it after each health round); one that fails is tried again next round."""
        for backend, pools in self.pools.items():
            wanted = [a for a in self.loaded.values() if a.backend == backend]
            for replica in (r for pool in pools for r in pool.replicas.values()):
                if not replica.upstream.healthy:
                    self._synced.discard(replica)
                elif replica not in self._synced:
                    try:
                        served = await _ask(replica, LIST) if wanted else {}
                        for adapter in (a for a in wanted if a.name not in served):
                            log.info("replica %s joined without LoRA adapter %r: loading it", replica.url, adapter.name)
                            await _ask(replica, _load_request(adapter.name, adapter.path))
                    except GatewayError as exc:
                        log.warning("giving replica %s the LoRA adapters loaded here failed: %s", replica.url, exc)
                        continue
                    self._synced.add(replica)

    async def load(self, name: str, path: str, backend: str) -> None:
        """Load on every replica of `backend`, or on none (GatewayError naming why)."""
        if name in self.models:
            raise GatewayError.invalid(f"'{name}' is a model the gateway serves: pick another lora_name", "lora_name")
        await self.refresh(force=True)
        if name in self.adapters:
            raise GatewayError.invalid(f"the LoRA adapter '{name}' is already loaded: unload it first", "lora_name")
        replicas = self._every_replica(backend)
        request = _load_request(name, path)
        done: list[ReplicaState] = []
        try:
            for replica in replicas:
                await _ask(replica, request)
                done.append(replica)
        except GatewayError as exc:
            unload = GenerateRequest(None, None, {}, texts={"lora_admin": "unload", "lora": name})
            await asyncio.gather(*(_ask(r, unload) for r in done), return_exceptions=True)
            if exc.param in ("lora", "lora_path"):  # the model's words for this route's fields
                exc.param = "lora_name" if exc.param == "lora" else "lora_path"
            raise
        self.adapters[name] = self.loaded[name] = Adapter(name, backend, path)

    async def unload(self, name: str) -> None:
        await self.refresh(force=True)
        adapter = self.adapters.get(name)
        if adapter is None:
            raise GatewayError(
                404, f"The LoRA adapter '{name}' is not loaded", "invalid_request_error", "lora_name", "model_not_found"
            )
        request = GenerateRequest(None, None, {}, texts={"lora_admin": "unload", "lora": name})
        del self.adapters[name]  # new requests: 404 now; running ones finish on their replicas
        self.loaded.pop(name, None)
        results = await asyncio.gather(
            *(_ask(r, request) for r in self._every_replica(adapter.backend)), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning("unloading LoRA adapter %r: %d replicas failed (%s)", name, len(failed), failed[0])

    def cards(self, created: float) -> list[dict[str, Any]]:
        """/v1/models entries (vLLM's: the adapter's directory as `root`, its backend as `parent`)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": int(created),
                "owned_by": "trtserve",
                "root": a.path,
                "parent": a.backend,
            }
            for a in self.adapters.values()
        ]

    def _every_replica(self, backend: str) -> list[ReplicaState]:
        pools = self.pools.get(backend)
        if pools is None:
            raise GatewayError.invalid(
                f"'{backend}' is not a backend of this gateway ({', '.join(self.pools)})", "model"
            )
        replicas = [r for pool in pools for r in pool.replicas.values()]
        unhealthy = [r.url for r in replicas if not r.sync_health()]
        if unhealthy:
            raise GatewayError.unavailable(
                f"replicas {', '.join(unhealthy)} of {backend!r} are not serving: every "
                "replica must take the adapter; retry once they are back"
            )
        return replicas


def _load_request(name: str, path: str) -> GenerateRequest:
    return GenerateRequest(None, None, {}, texts={"lora_admin": "load", "lora": name, "lora_path": path})


async def _ask(replica: ReplicaState, request: GenerateRequest) -> dict[str, str]:
    """A replica's answer to a lora_admin request: the adapters it serves after it."""
    text = "".join([delta.text async for delta in replica.upstream.generate(request, stream=False)])
    try:
        return dict(json.loads(text)["adapters"])
    except (ValueError, KeyError, TypeError):
        raise GatewayError(
            502, f"replica {replica.url} answered a LoRA request with {text[:200]!r}", "server_error"
        ) from None


class LoadLoraAdapter(Strict):
    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    model: str | None = None  # the backend that serves it (default: the only one)


class UnloadLoraAdapter(Strict):
    lora_name: AdapterName


def add_lora_routes(app: FastAPI, registry: LoraRegistry, authorize: Callable[[Request], object]) -> None:
    """`authorize`: raises unless the request carries an admin key."""

    @app.post("/v1/load_lora_adapter")
    async def load(http: Request) -> Response:
        authorize(http)
        body = await read_model(http, LoadLoraAdapter)
        if body.model is None and len(registry.pools) != 1:
            raise GatewayError.invalid(f"name the backend in 'model' ({', '.join(registry.pools)})", "model")
        backend = body.model if body.model is not None else next(iter(registry.pools))
        await registry.load(body.lora_name, body.lora_path, backend)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(http: Request) -> Response:
        authorize(http)
        body = await read_model(http, UnloadLoraAdapter)
        await registry.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

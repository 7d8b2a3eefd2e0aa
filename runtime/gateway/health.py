"""Keeps the replica pools current: readiness probes, load scrapes, DNS discovery.

- Every `health_interval_s`: discovered backends re-resolve their DNS name (new addresses join, vanished
  ones leave; a failed lookup keeps the current set), then every replica's model readiness is probed over
  gRPC. A replica failing its probe (or a call: Upstream marks it) is taken out of routing; it comes back
  as soon as a probe finds its model ready again.
- Every `metrics_interval_s`: each replica with a `metrics_url` is scraped for its engine's waiting /
  running requests and KV usage (vLLM's metric names first, trtserve's otherwise), and the LoRA adapters in its
  slots, series of other models on the same server ignored. A failed scrape leaves the previous one to age out.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
import urllib.request
from collections.abc import Awaitable, Callable

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from runtime.gateway.replica_config import Discovery
from runtime.gateway.replicas import EngineLoad, ReplicaPool, ReplicaState

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
# EngineLoad field -> metric names to read, in order of preference.
LOAD_METRICS: dict[str, tuple[str, ...]] = {
    "waiting": ("vllm:num_requests_waiting", "trtserve_num_requests_waiting"),
    "running": ("vllm:num_requests_running", "trtserve_num_requests_running"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "trtserve_kv_cache_usage_ratio"),
}
LORA_RESIDENT_METRIC = "trtserve_lora_resident"  # per adapter: 1 while in a slot (runtime/triton_model/metrics.py)
Resolver = Callable[[str, int], Awaitable[list[str]]]


def parse_engine_load(text: str, model: str, at: float) -> EngineLoad | None:
    """The engine gauges in a Prometheus text page (summed over `model`'s series; series labelled with
    another model are skipped); None when the page has no request gauges (not a trtserve/vLLM server)."""
    samples: dict[str, list[Sample]] = {}  # by family: a page without TYPE lines has a family per line
    for family in text_string_to_metric_families(text):
        samples.setdefault(family.name, []).extend(s for s in family.samples if s.labels.get("model", model) == model)
    values: dict[str, float] = {}
    for field_name, names in LOAD_METRICS.items():
        found = next((samples[n] for n in names if n in samples), None)
        if found is None:
            if field_name != "kv_usage":
                return None
            values[field_name] = 0.0
            continue
        values[field_name] = sum(s.value for s in found)
    resident = samples.get(LORA_RESIDENT_METRIC, [])
    loras = frozenset(s.labels["adapter"] for s in resident if s.value > 0 and "adapter" in s.labels)
    return EngineLoad(values["waiting"], values["running"], values["kv_usage"], at, loras)


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (a headless Service: its ready pods), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Monitor:
    """Runs the probe and scrape loops over `pools` until stopped; `on_removed` gets replicas that left, and
    `after_health` runs after each health round (what replicas that joined or came back need)."""

    def __init__(self, pools: dict[str, ReplicaPool], discover: dict[str, Discovery],
                 on_removed: Callable[[ReplicaState], None], resolver: Resolver = resolve,
                 after_health: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        self.pools, self.discover = pools, discover
        self.on_removed, self.resolver, self.after_health = on_removed, resolver, after_health
        self.discovered: dict[str, set[str]] = {name: set() for name in discover}  # urls DNS supplied
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, health_interval_s: float, metrics_interval_s: float) -> None:
        """Discover, probe and scrape once (the state is known before the first request), then loop."""
        await self.check_health()
        await self.scrape()
        self._tasks = [asyncio.create_task(self._every(health_interval_s, self.check_health)),
                       asyncio.create_task(self._every(metrics_interval_s, self.scrape))]  # fmt: skip

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def check_health(self) -> None:
        for name in self.discover:
            await self.rediscover(name)
        replicas = [r for pool in self.pools.values() for r in pool.replicas.values()]
        await asyncio.gather(*(r.upstream.probe() for r in replicas))
        for pool in self.pools.values():
            pool.publish_health()
        if self.after_health is not None:
            await self.after_health()

    async def rediscover(self, backend: str) -> None:
        discovery, pool = self.discover[backend], self.pools[backend]
        try:
            addresses = await self.resolver(discovery.host, discovery.grpc_port)
        except OSError as exc:  # DNS down or no ready pod: keep what we have (probes judge it)
            log.info("resolving %s failed (%s); keeping %d replicas", discovery.host, exc, len(pool.replicas))
            return
        wanted = {r.url: r for r in map(discovery.replica, addresses)}
        known = self.discovered[backend]
        for url in sorted(known - wanted.keys()):
            if url in pool.replicas:
                self.on_removed(pool.remove(url))
            known.discard(url)
        for url, replica in wanted.items():
            if url not in known and url not in pool.replicas:
                pool.add(replica)
                known.add(url)

    async def scrape(self) -> None:
        jobs = [(pool, r) for pool in self.pools.values() for r in pool.replicas.values() if r.replica.metrics_url]
        loads = await asyncio.gather(*(self._scrape_one(pool, r) for pool, r in jobs))
        for (pool, replica), load in zip(jobs, loads, strict=True):
            pool.record_engine(replica, load)

    async def _scrape_one(self, pool: ReplicaPool, replica: ReplicaState) -> EngineLoad | None:
        url = replica.replica.metrics_url
        assert url is not None
        try:
            text = await asyncio.to_thread(_fetch, url)
            return parse_engine_load(text, pool.triton_model, pool.clock())
        except (OSError, http.client.HTTPException, ValueError) as exc:  # unreachable, cut, not Prometheus text
            log.debug("scraping %s failed: %s", url, exc)
            return None

    async def _every(self, interval_s: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:  # a bug in one round must not end the loop
                log.exception("replica monitor round failed")


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return response.read().decode("utf-8", errors="replace")

"""Replica settings of the gateway's config: where a backend's tritonservers are, and how one is picked.

A backend lists its replicas (`replicas:`, or `url:` for one), or finds them in DNS (`discover:`, a
Kubernetes headless Service: every address the name resolves to is a ready pod). The `routing:`
section picks the replica policy and its knobs; a backend's `routing:` field overrides the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

ReplicaPolicy = Literal["prefix", "round_robin", "least_loaded"]
REPLICA_POLICIES: tuple[str, ...] = get_args(ReplicaPolicy)


@dataclass(frozen=True)
class Replica:
    url: str  # tritonserver's gRPC host:port
    metrics_url: str | None = None  # its Prometheus endpoint (Triton: http://host:8002/metrics); None: no load scrape
    # A warm spare (`trtserve serve` keeps one where memory allows): picked only while no other replica of its
    # backend is healthy, so a dead model's requests go on at once, on an engine already loaded, while that model is
    # restarted.
    standby: bool = False


@dataclass(frozen=True)
class Discovery:
    """Replicas from DNS: each address `host` resolves to, re-resolved every health interval."""

    host: str
    grpc_port: int = 8001
    metrics_port: int | None = 8002  # None: no load scrape

    def replica(self, address: str) -> Replica:
        host = f"[{address}]" if ":" in address else address  # IPv6 literal
        metrics = f"http://{host}:{self.metrics_port}/metrics" if self.metrics_port else None
        return Replica(f"{host}:{self.grpc_port}", metrics)


@dataclass(frozen=True)
class RoutingSettings:
    """How a request's replica is chosen (see runtime/gateway/replicas.py for the algorithm)."""

    policy: ReplicaPolicy = "prefix"
    chunk_chars: int = 64  # prompt characters per prefix hash: ~16 tokens, one engine KV block
    max_prefix_chunks: int = 512  # hashes per request (a 32k-character prefix); later text is not indexed
    index_chunks: int = 16384  # per replica, most recently routed first (LRU): ~1M characters of prefixes
    balance_abs: int = 8  # fall back to least loaded once the prefix choice carries this many more requests...
    balance_rel: float = 1.5  # ...and this many times the least loaded replica's load
    kv_usage_limit: float = 0.95  # a replica at this KV usage is passed over while another is below it
    # The replicas share a KV disk tier (trtserve serve --kv-disk-cache DIR on each): a prefix one computed is read
    # back by another instead of recomputed, so locality is worth less and a match gives way to a less loaded
    # replica at any gap (balance_abs and balance_rel are not used then).
    shared_kv_tier: bool = False
    health_interval_s: float = 2.0  # readiness probes (and DNS discovery)
    metrics_interval_s: float = 1.0  # load scrapes; a scrape older than 3 intervals is ignored
    max_attempts: int = 3  # replicas tried for a request that fails before its first token
    # How long a request that has produced nothing waits for a replica to be ready again when none is (a
    # restarting tritonserver comes back on its address within seconds); 0: fail at once. Below clients'
    # timeouts (the openai SDK's: 600 s).
    ready_wait_s: float = 30.0


# field -> (lowest allowed value, whether the value is an integer)
_LIMITS: dict[str, tuple[float, bool]] = {
    "chunk_chars": (1, True), "max_prefix_chunks": (1, True), "index_chunks": (1, True), "balance_abs": (1, True),
    "balance_rel": (1.0, False), "kv_usage_limit": (0.0, False), "health_interval_s": (0.01, False),
    "metrics_interval_s": (0.01, False), "max_attempts": (1, True), "ready_wait_s": (0.0, False),
}  # fmt: skip


def routing_from(path: str, value: object) -> RoutingSettings:
    """The `routing:` section (a mapping of RoutingSettings fields), unknown fields refused."""
    entries = _fields_of(RoutingSettings, path, value)
    settings = RoutingSettings(**entries)
    check_routing(path, settings)
    return settings


def check_routing(path: str, settings: RoutingSettings) -> None:
    check_policy(f"{path}.policy", settings.policy)
    for name, (low, integer) in _LIMITS.items():
        value = getattr(settings, name)
        kind = int if integer else (int, float)
        if not isinstance(value, kind) or isinstance(value, bool) or not low <= value < math.inf:
            raise ValueError(f"{path}.{name}: expected {'an integer' if integer else 'a number'} >= {low}, "
                             f"got {value!r}")  # fmt: skip
    if not isinstance(settings.shared_kv_tier, bool):
        raise ValueError(f"{path}.shared_kv_tier: expected true or false, got {settings.shared_kv_tier!r}")
    if settings.kv_usage_limit > 1:
        raise ValueError(f"{path}.kv_usage_limit: expected a fraction in [0, 1], got {settings.kv_usage_limit!r}")


def check_policy(path: str, policy: object) -> None:
    if policy not in REPLICA_POLICIES:
        raise ValueError(f"{path}: expected one of {', '.join(REPLICA_POLICIES)}, got {policy!r}")


def replicas_from(path: str, value: object) -> tuple[Replica, ...]:
    """`replicas:` entries: "host:port" strings or {url, metrics_url, standby} mappings."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path}: expected a non-empty list of replicas")
    out = []
    for i, entry in enumerate(value):
        if isinstance(entry, str):
            entry = {"url": entry}
        item = _fields_of(Replica, f"{path}[{i}]", entry)
        if "url" not in item:
            raise ValueError(f"{path}[{i}].url: required field missing")
        out.append(Replica(**item))
    return tuple(out)


def discovery_from(path: str, value: object) -> Discovery:
    item = _fields_of(Discovery, path, value)
    if "host" not in item:
        raise ValueError(f"{path}.host: required field missing")
    return Discovery(**item)


@dataclass(frozen=True)
class RoleSource:
    """A disaggregated backend's pool of one role (`prefill:` or `decode:`): its replicas, from exactly one of
    `url`, `replicas`, `discover`, as a backend's own."""

    url: str = ""
    replicas: tuple[Replica, ...] = ()
    discover: Discovery | None = None

    @property
    def configured_replicas(self) -> tuple[Replica, ...]:
        return self.replicas or ((Replica(self.url),) if self.url else ())


def role_source_from(path: str, value: object) -> RoleSource:
    """A `prefill:` or `decode:` section: a "host:port" string, or a mapping of url / replicas / discover."""
    item = _fields_of(RoleSource, path, {"url": value} if isinstance(value, str) else value)
    if "replicas" in item:
        item["replicas"] = replicas_from(f"{path}.replicas", item["replicas"])
    if "discover" in item:
        item["discover"] = discovery_from(f"{path}.discover", item["discover"])
    source = RoleSource(**item)
    check_sources(path, source.url, source.replicas, source.discover)
    return source


def check_sources(path: str, url: str, replicas: tuple[Replica, ...], discover: Discovery | None,
                  optional: bool = False) -> None:  # fmt: skip
    """A backend's replicas come from exactly one of `url`, `replicas`, `discover` (or none, when `optional`:
    a disaggregated backend's own replicas, its `both` workers, are its fallback)."""
    given = [name for name, value in (("url", url), ("replicas", replicas), ("discover", discover)) if value]
    if not given and optional:
        return
    if not given:
        raise ValueError(f"{path}.url: required field missing (or list `replicas`, or `discover` them)")
    if len(given) > 1:
        raise ValueError(f"{path}.{given[1]}: give one of url, replicas, discover (got {' and '.join(given)})")
    if url:
        check_grpc_url(f"{path}.url", url)
    if discover is not None:
        check_discovery(f"{path}.discover", discover)
    seen = set()
    for i, replica in enumerate(replicas):
        check_replica(f"{path}.replicas[{i}]", replica)
        if replica.url in seen:
            raise ValueError(f"{path}.replicas[{i}].url: {replica.url!r} is listed twice")
        seen.add(replica.url)


def check_replica(path: str, replica: Replica) -> None:
    check_grpc_url(f"{path}.url", replica.url)
    if replica.metrics_url is not None:
        check_http_url(f"{path}.metrics_url", replica.metrics_url)
    if not isinstance(replica.standby, bool):
        raise ValueError(f"{path}.standby: expected true or false, got {replica.standby!r}")


def check_http_url(path: str, url: object) -> None:
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{path}: expected an http(s):// URL, got {url!r}")


def check_discovery(path: str, discovery: Discovery) -> None:
    if not isinstance(discovery.host, str) or not discovery.host or ":" in discovery.host:
        raise ValueError(f"{path}.host: expected a DNS name without a port, got {discovery.host!r}")
    for name in ("grpc_port", "metrics_port"):
        port = getattr(discovery, name)
        if port is None and name == "metrics_port":
            continue
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"{path}.{name}: expected a port number, got {port!r}")


def check_grpc_url(path: str, url: object) -> None:
    if not isinstance(url, str) or not url:
        raise ValueError(f"{path}: expected a non-empty string, got {url!r}")
    host, sep, port = url.rpartition(":")
    if not (host and sep and port.isdigit() and 0 < int(port) < 65536) or "/" in url:
        raise ValueError(f"{path}: expected tritonserver's gRPC host:port, got {url!r}")


def _fields_of(cls: type, path: str, value: object) -> dict[str, Any]:
    """A mapping whose keys are all fields of the dataclass `cls` (the unknown one is named)."""
    item = _mapping(path, value)
    allowed = [f.name for f in fields(cls)]
    for key in item:
        if key not in allowed:
            raise ValueError(f"{path}.{key}: unknown field (expected {', '.join(allowed)})")
    return item


def _mapping(path: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{path}: expected a mapping, got {type(value).__name__}")
    return value

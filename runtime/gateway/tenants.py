"""Tenants: who a request is for (from its API key), what it may use, and whose caches it may share.

Each tenant has its own API key, its own limits in the admission queue (runtime.gateway.fair_queue:
requests upstream at once, requests waiting) and its own prefix-cache salt. The gateway config file's
`tenants:` section lists them:

    tenants:
      acme:
        key_env: ACME_API_KEY   # the key, from this environment variable; or `key: sk-...` in the file
        max_concurrent: 16      # its requests upstream at once (default: --per-key-concurrency)
        max_queued: 64          # its requests waiting for a slot (default: bounded by --max-queued only)
        admin: true             # may use /admin (replicas, per-tenant metrics); default false

The same section alone in a file of its own is `trtserve gateway --tenants FILE` (beside --triton-url and
--model, as `trtserve serve` starts the gateway). `--api-key K` is the one-tenant shorthand (an admin
tenant named `key:<digest of K>`, limits from the flags). With neither, the gateway is open: no key is
asked for, /admin is refused, fairness keys come from OpenAI's `user` field or the client's address, and
only a client's own `cache_salt` separates caches.

With tenants, a request's fairness key is its tenant (a client-chosen `user` would let one tenant spread
over many keys and past its limits). Its cache salt is `tenant_cache_salt(tenant key, client salt)`: the
tenant's secret key mixed with the `cache_salt` the client sent, so a client may split its tenant's cache
but can never produce another tenant's salt. The engine shares KV blocks only within a salt, and the
gateway's prefix index (runtime.gateway.prefix_index) is keyed by the same salt, so no tenant's prompt can
match another's, in the engine or in routing: a guess of another tenant's prompt is indistinguishable from
any other miss, including on /metrics (`trtserve_gateway_replica_picks_total{reason="prefix_match"}`).

/metrics stays public (Prometheus scrapes it without credentials) and carries no per-tenant series: the
queue's per-key series are served at /admin/metrics, to admin keys only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runtime.gateway.config_file import read_file
from runtime.gateway.fair_queue import KeyLimits

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")  # a Prometheus label value an operator can read


@dataclass(frozen=True)
class Tenant:
    name: str  # a label value in per-tenant metrics; never the key
    key: str = field(repr=False)
    limits: KeyLimits = field(default_factory=KeyLimits)
    admin: bool = False

    def matches(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.key.encode())


def shorthand(api_key: str) -> Tenant:
    """`--api-key`: the only tenant, an admin, named by a digest of its key (keys become metric labels)."""
    return Tenant("key:" + hashlib.sha256(api_key.encode()).hexdigest()[:12], api_key, admin=True)


def find(tenants: tuple[Tenant, ...], given: str) -> Tenant | None:
    """The tenant whose key is `given`: every key is compared, in constant time each, whichever matches."""
    found = None
    for tenant in tenants:
        if tenant.matches(given):
            found = tenant
    return found


def tenant_cache_salt(key: str | None, client_salt: str | None) -> str | None:
    """The prefix-cache salt sent upstream: the tenant's, from its API key (hashed: the key never leaves
    the gateway), mixed with the client's own `cache_salt`. None (the shared cache) without either."""
    if key is None and client_salt is None:
        return None
    material = f"trtserve-cache-salt\0{key or ''}\0{client_salt or ''}"
    return hashlib.sha256(material.encode()).hexdigest()


FIELDS = ("key", "key_env", "max_concurrent", "max_queued", "admin")


def tenants_from(path: str, value: object, environ: Mapping[str, str] = os.environ) -> tuple[Tenant, ...]:
    """The `tenants:` section: {name: {key | key_env, max_concurrent?, max_queued?, admin?}}."""
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{path}: expected a mapping of tenant names to their keys and limits")
    tenants, keys = [], set()
    for name, entry in value.items():
        where = f"{path}.{name}"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}: a tenant's name must be 1-64 letters, digits, '_', '.', ':' or '-'")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping with key or key_env")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown field (expected {', '.join(FIELDS)})")
        key = _key(where, entry, environ)
        if key in keys:
            raise ValueError(f"{where}: its key is another tenant's too; each tenant needs its own")
        keys.add(key)
        limits = KeyLimits(_count(f"{where}.max_concurrent", entry.get("max_concurrent"), 1),
                           _count(f"{where}.max_queued", entry.get("max_queued"), 0))  # fmt: skip
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}.admin: expected true or false, got {admin!r}")
        tenants.append(Tenant(name, key, limits, admin))
    return tuple(tenants)


def tenants_file(path: str | Path) -> tuple[Tenant, ...]:
    """A .yaml/.toml file holding only a `tenants:` section (`trtserve gateway --tenants`, beside
    --triton-url/--model: what `trtserve serve` passes)."""

    def only_tenants(data: object) -> tuple[Tenant, ...]:
        if not isinstance(data, dict) or set(data) != {"tenants"}:
            found = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"expected only a tenants section, got {found or 'nothing'}")
        return tenants_from("tenants", data["tenants"])

    return read_file(path, only_tenants)


def _key(where: str, entry: dict, environ: Mapping[str, str]) -> str:
    if ("key" in entry) == ("key_env" in entry):
        raise ValueError(f"{where}: give exactly one of key, key_env")
    if "key_env" in entry:
        variable = entry["key_env"]
        if not isinstance(variable, str) or not variable:
            raise ValueError(f"{where}.key_env: expected an environment variable's name, got {variable!r}")
        key: object = environ.get(variable, "")
        if not key:
            raise ValueError(f"{where}.key_env: the environment variable {variable} is not set")
        where = f"{where}.key_env ({variable})"
    else:
        key, where = entry["key"], f"{where}.key"
    if not isinstance(key, str) or not key or key != key.strip() or not key.isprintable():
        raise ValueError(f"{where}: a key must be a non-empty printable string without surrounding spaces")
    return key


def _count(where: str, value: object, low: int) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{where}: expected an integer >= {low}, got {value!r}")
    return value

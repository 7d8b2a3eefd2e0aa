"""Tenants: several API keys, each its own tenant with its own limits and cache salt.

Without servers: the config's `tenants:` section (keys given or read from the environment, limits, admin)
and its errors; each key maps to its tenant and its limits in the admission queue; a bad key is 401; the
prefix index is keyed by the tenant's salt, so another tenant's correct guess of a prompt matches nothing.

Against a real tritonserver (the slow random Llama, two sequences at once): the prefix-match pick counter
on the public /metrics, once an oracle for another tenant's prompts, moves for a tenant's own repeats only;
a tenant at its limits gets 429 while another is served; per-tenant series are on /admin/metrics only.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry
from starlette.requests import Request

from runtime.gateway.errors import GatewayError
from runtime.gateway.fair_queue import KeyLimits
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.protocol import ChatCompletionRequest
from runtime.gateway.replica_config import Replica, RoutingSettings
from runtime.gateway.replicas import NO_PREFIX_MATCH, PREFIX_MATCH, ReplicaPool
from runtime.gateway.routing import GatewayConfig
from runtime.gateway.service import Gateway, GatewaySettings
from runtime.gateway.tenants import Tenant, tenant_cache_salt, tenants_from
from runtime.serve.launcher import TritonServer
from tests.gateway_helpers import build_slow_engine, client, gateway_metrics, running_gateway, running_servers
from tests.triton_helpers import wait_for

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"
TENANTS = {
    "alice": {"key": ALICE, "admin": True},
    "bob": {"key_env": "TRTSERVE_TEST_BOB_KEY", "max_concurrent": 1, "max_queued": 0},
    "carol": {"key": CAROL, "max_queued": 3},
}
ENV = {"TRTSERVE_TEST_BOB_KEY": BOB}
SYSTEM = ("You are the archivist of a small observatory. Answer with the catalogue number of each plate you cite, "
          "and say when a plate is missing from the drawer. ") * 3  # fmt: skip


def request(authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "headers": headers, "client": ("10.1.2.3", 5000)})


def gateway_of(tenants: dict = TENANTS, **settings: object) -> Gateway:
    config = GatewayConfig.from_dict({"backends": {"m": {"url": "h:1"}}})
    config = GatewayConfig(config.backends, tenants=tenants_from("tenants", tenants, ENV))
    return Gateway(config, GatewaySettings(per_key_concurrency=8, **settings))  # type: ignore[arg-type]


# --- keys, tenants, limits ---


def test_each_key_maps_to_its_tenant_and_its_limits():
    gateway = gateway_of()
    seen = {key: gateway.authorize(request(f"Bearer {key}")) for key in (ALICE, BOB, CAROL)}
    assert {key: t.name for key, t in seen.items() if t} == {ALICE: "alice", BOB: "bob", CAROL: "carol"}
    assert [seen[k].limits for k in (ALICE, BOB, CAROL)] == [KeyLimits(), KeyLimits(1, 0), KeyLimits(None, 3)]
    queue = gateway.queue
    assert [queue.concurrency(n) for n in ("alice", "bob", "carol")] == [8, 1, 8]
    assert queue.key_limits == {"alice": KeyLimits(), "bob": KeyLimits(1, 0), "carol": KeyLimits(None, 3)}
    # The fairness key is the tenant: a client-chosen `user` cannot spread a tenant over several keys.
    assert gateway.queue_key(request(), seen[BOB], "someone-else") == "bob"
    assert gateway.queue_key(request(), None, "u1") == "user:u1" and gateway.queue_key(request(), None, None) == (
        "addr:10.1.2.3")  # fmt: skip
    assert repr(seen[ALICE]).count(ALICE) == 0  # keys stay out of logs


@pytest.mark.parametrize("authorization", [None, "Bearer sk-nobody", f"Bearer {ALICE}x", f"Basic {ALICE}", ALICE,
                                           f"Bearer {ALICE[:-1]}", f"Bearer {BOB.upper()}"])  # fmt: skip
def test_a_bad_key_is_401(authorization):
    with pytest.raises(GatewayError) as caught:
        gateway_of().authorize(request(authorization))
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")


def test_only_admin_tenants_reach_the_admin_api():
    gateway = gateway_of()
    assert gateway.authorize(request(f"Bearer {ALICE}"), admin=True).name == "alice"
    with pytest.raises(GatewayError) as caught:
        gateway.authorize(request(f"Bearer {BOB}"), admin=True)
    assert (caught.value.status, caught.value.code) == (403, "not_admin")


def test_the_single_api_key_is_a_one_tenant_shorthand_and_excludes_a_tenants_section():
    gateway = Gateway(GatewayConfig.single("m", "h:1"), GatewaySettings(api_key="sk-1", per_key_concurrency=5))
    [tenant] = gateway.tenants
    assert tenant.admin and tenant.name.startswith("key:") and "sk-1" not in tenant.name
    assert gateway.authorize(request("Bearer sk-1")) is tenant and gateway.queue.concurrency(tenant.name) == 5
    with pytest.raises(ValueError, match="not both"):
        gateway_of(api_key="sk-1")


def yaml_config(tmp_path: Path, tenants: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text("backends:\n  m: {url: 'h:1'}\ntenants:\n" + tenants)
    return path


def test_tenants_load_from_yaml_with_keys_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSERVE_TEST_KEY", "sk-from-env")
    path = yaml_config(tmp_path, "  a: {key_env: TRTSERVE_TEST_KEY, max_concurrent: 2, max_queued: 0}\n"
                                 "  b: {key: sk-b, admin: true}\n")  # fmt: skip
    assert GatewayConfig.load(path).tenants == (Tenant("a", "sk-from-env", KeyLimits(2, 0)),
                                                Tenant("b", "sk-b", KeyLimits(), admin=True))  # fmt: skip


@pytest.mark.parametrize(
    ("tenants", "error"),
    [
        ("  a: {}\n", r"tenants\.a: give exactly one of key, key_env"),
        ("  a: {key: k, key_env: V}\n", r"tenants\.a: give exactly one of key, key_env"),
        ("  a: {key_env: TRTSERVE_TEST_UNSET}\n", r"tenants\.a\.key_env: the environment variable TRTSERVE_TEST_UNSET"),
        ("  a: {key: ' k'}\n", r"tenants\.a\.key: a key must be a non-empty printable string"),
        ("  a: {key: k}\n  b: {key: k}\n", r"tenants\.b: its key is another tenant's too"),
        ("  a: {key: k, max_concurrent: 0}\n", r"tenants\.a\.max_concurrent: expected an integer >= 1, got 0"),
        ("  a: {key: k, max_queued: -1}\n", r"tenants\.a\.max_queued: expected an integer >= 0, got -1"),
        ("  a: {key: k, admin: 'yes'}\n", r"tenants\.a\.admin: expected true or false"),
        ("  a: {key: k, rate: 5}\n", r"tenants\.a\.rate: unknown field"),
        ("  'a b': {key: k}\n", r"tenants\.a b: a tenant's name must be"),
        ("  {}\n", r"tenants: expected a mapping of tenant names"),
    ],
)  # fmt: skip
def test_bad_tenant_configs_name_the_field(tmp_path, monkeypatch, tenants, error):
    monkeypatch.delenv("TRTSERVE_TEST_UNSET", raising=False)
    with pytest.raises(ValueError, match=error):
        GatewayConfig.load(yaml_config(tmp_path, tenants))


# --- the prefix index is keyed by the tenant's salt ---


def upstream_request(gateway: Gateway, key: str, client_salt: str | None = None):
    tenant = gateway.authorize(request(f"Bearer {key}"))
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plate 17?"}]})  # fmt: skip
    [upstream] = body.upstream_requests(gateway.cache_salt(tenant, client_salt))
    return upstream


def test_a_correct_guess_under_another_tenants_key_matches_nothing_in_the_index_or_the_metric():
    gateway = gateway_of()
    registry = CollectorRegistry()
    pool = ReplicaPool("m", "llm", [Replica("10.0.0.1:8001"), Replica("10.0.0.2:8001")], RoutingSettings(), "prefix",
                       GatewayMetrics.create(registry))  # fmt: skip
    for replica in pool.replicas.values():
        replica.upstream.healthy = True

    def send(key: str, client_salt: str | None = None) -> tuple[str, int]:
        wanted = upstream_request(gateway, key, client_salt)
        hashes = pool.prefix_key(wanted)
        pick = pool.pick(hashes)
        with pool.lease(pick, hashes):
            pass
        return pick.reason, pick.matched_chunks

    def prefix_matches() -> float:
        return sum(registry.get_sample_value("trtserve_gateway_replica_picks_total",
                                             {"backend": "m", "replica": url, "reason": PREFIX_MATCH}) or 0.0
                   for url in pool.replicas)  # fmt: skip

    alice = pool.prefix_key(upstream_request(gateway, ALICE))
    assert send(ALICE) == (NO_PREFIX_MATCH, 0)
    where = {url: r.index.match(alice) for url, r in pool.replicas.items()}  # all chunks on one replica
    assert sorted(where.values()) == [0, len(alice)]
    for key, salt in ((BOB, None), (BOB, "guess"), (CAROL, None)):  # the same prompt, under other salts
        guess = pool.prefix_key(upstream_request(gateway, key, salt))
        assert len(guess) == len(alice) and not set(guess) & set(alice)
        assert send(key, salt) == (NO_PREFIX_MATCH, 0)
        assert {url: r.index.match(alice) for url, r in pool.replicas.items()} == where  # alice's entries intact
    assert prefix_matches() == 0  # +0 for every correct guess under another salt
    assert send(ALICE) == (PREFIX_MATCH, len(alice)) and prefix_matches() == 1  # the tenant's own repeat: +1
    assert send(BOB) == (PREFIX_MATCH, len(alice)) and prefix_matches() == 2  # bob's own repeat


def test_salts_differ_per_tenant_and_client_salt_and_never_leave_the_tenant():
    gateway = gateway_of()
    salts = {(k, c): upstream_request(gateway, k, c).cache_salt for k in (ALICE, BOB) for c in (None, "x")}
    assert len(set(salts.values())) == 4
    assert salts[(ALICE, "x")] == tenant_cache_salt(ALICE, "x") and ALICE not in str(salts.values())


# --- against a real tritonserver ---


@pytest.fixture(scope="module")
def triton(engines_dir) -> Iterator[TritonServer]:
    with running_servers(build_slow_engine(engines_dir), 1, {"max_num_seqs": "2"}) as [server]:
        yield server


@pytest.fixture(scope="module")
def gateway(triton, tmp_path_factory):
    config = {"backends": {"slow": {"url": f"127.0.0.1:{triton.config.grpc_port}"}},
              "routing": {"policy": "prefix", "health_interval_s": 0.3}, "tenants": TENANTS}  # fmt: skip
    path = tmp_path_factory.mktemp("tenants") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    os.environ.update(ENV)  # read by the gateway process at start
    try:
        with running_gateway(None, None, "--config", str(path)) as gw:
            yield gw
    finally:
        for name in ENV:
            os.environ.pop(name, None)


def ask(gw, key: str, **kwargs):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which plate shows Vega?"}]
    return client(gw.url, key).chat.completions.create(model="slow", messages=messages, **kwargs)


def picks(gw) -> dict[str, float]:
    counts: dict[str, float] = {}
    for name, value in gateway_metrics(gw).items():
        if name.startswith("trtserve_gateway_replica_picks_total"):
            reason = name.split('reason="')[1].split('"')[0]
            counts[reason] = counts.get(reason, 0) + value
    return counts


@pytest.mark.serving
def test_the_public_prefix_match_counter_moves_for_a_tenants_own_repeats_only(gateway):
    def delta_after(key: str, **kwargs) -> dict[str, float]:
        before = picks(gateway)
        assert ask(gateway, key, max_tokens=1, **kwargs).usage.completion_tokens == 1
        after = picks(gateway)
        return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}

    assert delta_after(ALICE) == {NO_PREFIX_MATCH: 1}
    assert delta_after(BOB) == {NO_PREFIX_MATCH: 1}  # a correct guess of alice's prompt: +0 prefix matches
    assert delta_after(BOB, extra_body={"cache_salt": "alice"}) == {NO_PREFIX_MATCH: 1}  # no salt reaches hers
    assert delta_after(ALICE) == {PREFIX_MATCH: 1}
    assert delta_after(BOB) == {PREFIX_MATCH: 1}


@pytest.mark.serving
def test_a_tenant_at_its_limits_gets_429_while_others_are_served(gateway):
    stream = ask(gateway, BOB, stream=True, max_tokens=1500, extra_body={"ignore_eos": True})
    try:
        assert next(iter(stream)).choices[0].delta.role == "assistant"  # bob's one slot is held
        with pytest.raises(openai.RateLimitError) as refused:
            ask(gateway, BOB, max_tokens=1)
        assert refused.value.code == "overloaded" and int(refused.value.response.headers["Retry-After"]) >= 1
        assert ask(gateway, CAROL, max_tokens=1).usage.completion_tokens == 1
        tenants = gateway_metrics(gateway, "/admin/metrics", ALICE)
        assert tenants['trtserve_gateway_queue_rejections_total{key="bob"}'] == 1
        assert tenants['trtserve_gateway_key_in_flight{key="bob"}'] == 1
    finally:
        stream.close()
    public = gateway_metrics(gateway)
    assert not any("key=" in name for name in public)
    assert wait_for(lambda: gateway_metrics(gateway)["trtserve_gateway_in_flight"] == 0)
    with pytest.raises(urllib.error.HTTPError) as not_admin:
        gateway_metrics(gateway, "/admin/metrics", BOB)
    assert not_admin.value.code == 403 and json.loads(not_admin.value.read())["error"]["code"] == "not_admin"


@pytest.mark.serving
def test_bad_keys_are_401_on_every_endpoint(gateway):
    for key in ("sk-nobody", ALICE + "x"):
        with pytest.raises(openai.AuthenticationError) as caught:
            client(gateway.url, key).models.list()
        assert caught.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            ask(gateway, key, max_tokens=1)
    assert [m.id for m in client(gateway.url, CAROL).models.list()] == ["slow"]
    with pytest.raises(urllib.error.HTTPError) as unauthenticated:
        urllib.request.urlopen(f"{gateway.url}/admin/metrics", timeout=10)
    assert unauthenticated.value.code == 401

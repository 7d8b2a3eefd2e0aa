"""The gateway's LoRA routing without servers: prompts keyed by adapter, a replica holding the adapter preferred,
the engine's resident-adapter gauge read from a scrape, and the adapter registry's answers and refusals. Replicas'
health and load are set directly; time comes from an injected clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from runtime.gateway.errors import GatewayError
from runtime.gateway.health import parse_engine_load
from runtime.gateway.loras import LoraRegistry
from runtime.gateway.replica_config import Replica
from runtime.gateway.replicas import LEAST_LOADED, LORA_RESIDENT, NO_PREFIX_MATCH, PREFIX_MATCH, EngineLoad
from runtime.gateway.wire import Delta, GenerateRequest
from tests.test_gateway_balancing import SYSTEM, A, B, C, Clock, chat, pool


def for_adapter(request: GenerateRequest, lora: str | None) -> GenerateRequest:
    return GenerateRequest(request.prompt, request.messages, request.params, lora=lora)


def test_prompts_are_keyed_by_adapter_as_the_engine_keys_its_blocks():
    p = pool("prefix")
    base = p.prefix_key(chat(SYSTEM, "q"))
    under_a, under_b = (p.prefix_key(for_adapter(chat(SYSTEM, "q"), name)) for name in ("a", "b"))
    assert len(base) == len(under_a) == len(under_b) == 9
    assert not set(base) & set(under_a) and not set(under_a) & set(under_b)
    p.replicas[A].index.insert(under_a)
    assert p.pick(under_a).reason == PREFIX_MATCH and p.pick(under_b).reason == NO_PREFIX_MATCH


def test_without_a_prefix_match_a_replica_holding_the_adapter_is_preferred_unless_overloaded():
    clock = Clock()
    p = pool("prefix", clock=clock, balance_abs=8, balance_rel=1.5)
    hashes = p.prefix_key(for_adapter(chat(SYSTEM, "q"), "a"))
    p.record_engine(p.replicas[C], EngineLoad(0, 3, 0.1, clock.now, frozenset({"a"})))
    pick = p.pick(hashes, lora="a")
    assert (pick.replica.url, pick.reason) == (C, LORA_RESIDENT)  # A and B are idle, but would page "a" in
    assert p.pick(hashes).reason == NO_PREFIX_MATCH  # the base model: least loaded
    p.record_engine(p.replicas[C], EngineLoad(0, 9, 0.1, clock.now, frozenset({"a"})))  # 9 more than A and B
    assert (p.pick(hashes, lora="a").reason, p.pick(hashes, lora="a").replica.url) == (NO_PREFIX_MATCH, A)
    least = pool("least_loaded", clock=clock)
    least.record_engine(least.replicas[B], EngineLoad(0, 1, 0.1, clock.now, frozenset({"a"})))
    assert (least.pick([], lora="a").replica.url, least.pick([], lora="a").reason) == (B, LORA_RESIDENT)
    assert least.pick([], lora="b").reason == LEAST_LOADED
    clock.now += 100  # a stale scrape says nothing about the slots
    assert least.pick([], lora="a").reason == LEAST_LOADED


def test_the_scrape_reads_which_adapters_are_resident():
    page = (
        'trtserve_num_requests_waiting{model="llm",version="1"} 0\n'
        'trtserve_num_requests_running{model="llm",version="1"} 2\n'
        'trtserve_lora_resident{model="llm",version="1",adapter="a"} 1\n'
        'trtserve_lora_resident{model="llm",version="1",adapter="b"} 0\n'
        'trtserve_lora_resident{model="other",version="1",adapter="c"} 1\n'
    )
    assert parse_engine_load(page, "llm", 1.0) == EngineLoad(0, 2, 0.0, 1.0, frozenset({"a"}))


class FakeUpstream:
    """A replica's model answering lora_admin requests as runtime/triton_model/lora_admin.py does."""

    def __init__(self, served: dict[str, str], refuse: str | None = None) -> None:
        self.served, self.refuse = served, refuse
        self.calls: list[dict] = []

    async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        texts = dict(request.texts)
        self.calls.append(texts)
        if texts["lora_admin"] == "load":
            if self.refuse is not None:
                raise GatewayError.invalid(self.refuse, "lora_path")
            self.served[str(texts["lora"])] = str(texts["lora_path"])
        elif texts["lora_admin"] == "unload":
            self.served.pop(str(texts["lora"]), None)
        yield Delta(json.dumps({"adapters": self.served}), "stop", 0, 0)


def registry(*upstreams: FakeUpstream) -> LoraRegistry:
    p = pool("prefix", urls=(A, B, C)[: len(upstreams)])
    for replica, upstream in zip(p.replicas.values(), upstreams, strict=True):
        replica.upstream = upstream  # type: ignore[assignment]
        replica.upstream.healthy = True  # type: ignore[attr-defined]
    return LoraRegistry({"m": [p]}, ["m"], clock=Clock())


def test_adapters_are_learned_from_the_backends_and_a_backend_name_is_never_an_adapter():
    reg = registry(FakeUpstream({"a": "/x/a", "m": "/x/m"}), FakeUpstream({"a": "/x/a"}))
    asyncio.run(reg.refresh())
    assert [(a.name, a.backend, a.path) for a in reg.adapters.values()] == [("a", "m", "/x/a")]
    assert reg.cards(5.0) == [
        {"id": "a", "object": "model", "created": 5, "owned_by": "trtserve", "root": "/x/a", "parent": "m"}
    ]


def test_a_load_reaches_every_replica_or_none():
    good, bad = FakeUpstream({}), FakeUpstream({}, refuse="lora: LoRA adapter 'z': r: rank 128 is above 64")
    reg = registry(good, bad)
    with pytest.raises(GatewayError) as refused:
        asyncio.run(reg.load("z", "/x/z", "m"))
    assert refused.value.status == 400 and refused.value.param == "lora_path" and "rank 128" in str(refused.value)
    assert good.served == {} and [c["lora_admin"] for c in good.calls] == ["list", "load", "unload"]  # undone
    assert "z" not in reg.adapters
    both = registry(FakeUpstream({}), FakeUpstream({}))
    asyncio.run(both.load("z", "/x/z", "m"))
    assert "z" in both.adapters
    with pytest.raises(GatewayError, match="already loaded"):
        asyncio.run(both.load("z", "/x/z", "m"))
    with pytest.raises(GatewayError, match="'m' is a model the gateway serves"):
        asyncio.run(both.load("m", "/x/m", "m"))
    asyncio.run(both.unload("z"))
    with pytest.raises(GatewayError, match="'z' is not loaded") as missing:
        asyncio.run(both.unload("z"))
    assert missing.value.status == 404


def test_a_load_waits_for_every_replica_to_serve():
    reg = registry(FakeUpstream({}), FakeUpstream({}))
    next(iter(reg.pools["m"][0].replicas.values())).upstream.healthy = False
    with pytest.raises(GatewayError, match="are not serving: every replica must take the adapter") as down:
        asyncio.run(reg.load("z", "/x/z", "m"))
    assert down.value.status == 503


def test_a_disaggregated_backend_loads_on_its_prefill_and_decode_workers():
    """A backend with no `both` replicas: its adapters are listed by a prefill or decode worker, and a load
    reaches every worker of both roles (a decode worker continues KV only under the adapter it holds)."""
    own = pool("prefix", urls=())
    roles = [pool("prefix", urls=(A,)), pool("least_loaded", urls=(B, C))]
    workers = [FakeUpstream({"a": "/x/a"}), FakeUpstream({"a": "/x/a"}), FakeUpstream({"a": "/x/a"})]
    for replica, upstream in zip([r for p in roles for r in p.replicas.values()], workers, strict=True):
        replica.upstream = upstream  # type: ignore[assignment]
        replica.upstream.healthy = True  # type: ignore[attr-defined]
    reg = LoraRegistry({"m": [own, *roles]}, ["m"], clock=Clock())
    asyncio.run(reg.load("z", "/x/z", "m"))
    assert [w.served for w in workers] == [{"a": "/x/a", "z": "/x/z"}] * 3
    assert sorted(reg.adapters) == ["a", "z"]
    asyncio.run(reg.unload("z"))
    assert [w.served for w in workers] == [{"a": "/x/a"}] * 3


def test_a_replica_that_joins_later_is_given_the_adapters_loaded_through_the_gateway():
    """Scale-out (or one back from being down): the monitor's round after it serves gives it what was loaded
    at run time, not what the other replicas started with; an unloaded adapter is not given."""
    first, second = FakeUpstream({"boot": "/x/boot"}), FakeUpstream({"boot": "/x/boot"})
    reg = registry(first, second)
    asyncio.run(reg.load("z", "/x/z", "m"))
    asyncio.run(reg.load("gone", "/x/gone", "m"))
    asyncio.run(reg.unload("gone"))
    asyncio.run(reg.sync())  # every replica took "z" at its load: nothing to give (one list each)
    assert [c["lora_admin"] for c in first.calls][-1:] == ["list"] and "z" in first.served
    pool = reg.pools["m"][0]
    joiner = FakeUpstream({"boot": "/x/boot"})
    state = pool.add(Replica(C))
    state.upstream = joiner  # type: ignore[assignment]
    joiner.healthy = True  # type: ignore[attr-defined]
    asyncio.run(reg.refresh(force=True))
    assert "z" in reg.adapters  # known even if the joiner is the replica asked
    asyncio.run(reg.sync())
    assert joiner.served == {"boot": "/x/boot", "z": "/x/z"}
    calls = len(joiner.calls)
    asyncio.run(reg.sync())
    assert len(joiner.calls) == calls  # synced once
    joiner.healthy = False  # type: ignore[attr-defined]
    asyncio.run(reg.sync())
    joiner.healthy, joiner.served = True, {}  # type: ignore[attr-defined]  # back, its state lost
    asyncio.run(reg.sync())
    assert joiner.served == {"z": "/x/z"}

"""The gateway's side of disaggregation without servers: the config's prefill/decode pools (YAML and CLI), the
wire encoding of prefill_only / kv_handle, the KV handle's format and the handshake's comparison, and the
flow's failure branches over fake upstreams: a prefill retried elsewhere, a decode worker that is overloaded
replaced, any other decode failure recomputed on a `both` worker (or another decode worker) and never sent
to a second reader, and the clear error when nothing is left."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from engine_format.kv_handle import KVHandle, KVHandleError, KVLayout, KVRegion, compatibility_problem, with_recompute
from executors.kv_transfer import block_descriptors
from runtime.engine.engine_args import EngineArgs, from_parameters, to_parameters
from runtime.gateway.cli import gateway
from runtime.gateway.errors import GatewayError
from runtime.gateway.exchange import Exchange
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.replica_config import Replica, RoutingSettings
from runtime.gateway.replicas import ReplicaPool
from runtime.gateway.routing import EXPLICIT, GatewayConfig, RouteDecision, Router
from runtime.gateway.service import Gateway, GatewaySettings
from runtime.gateway.upstream import KV_TRANSFER_CODE, classify
from runtime.gateway.wire import Delta, GenerateRequest, build_request, parse_response
from tests.gateway_helpers import stream_exchange

LAYOUT = KVLayout(num_layers=2, block_size=8, kv_width=16, num_kv_heads=2, dtype="float32", kv_cache_dtype="auto")


def handle(**changes: object) -> KVHandle:
    base = KVHandle("h1", "nixl", "agent-p", "bWQ=", {"weights_sha256": "ab"}, LAYOUT,
                    (KVRegion("data", 4096, 10, 512),), (3, 4), tuple(range(12)), 7, 2e9)  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# --- the handle and the handshake's comparison ---


def test_a_handle_round_trips_and_is_marked_for_recompute():
    text = handle().to_json()
    assert KVHandle.from_json(text) == handle()
    assert KVHandle.from_json(with_recompute(text)) == handle(recompute=True)
    for bad in ("{", "[]", json.dumps({**json.loads(text), "version": 9}), json.dumps({**json.loads(text), "x": 1})):
        with pytest.raises(KVHandleError, match="kv_handle: "):
            KVHandle.from_json(bad)


def test_the_comparison_names_the_first_field_that_differs():
    assert compatibility_problem({"weights_sha256": "ab"}, LAYOUT, handle()) is None
    peer = handle(layout=dataclasses.replace(LAYOUT, block_size=16))
    assert compatibility_problem({"weights_sha256": "ab"}, LAYOUT, peer) == (
        "KV layout differs: peer agent 'agent-p' has block_size 16, this worker 8"
    )
    assert (
        compatibility_problem({"weights_sha256": "cd"}, LAYOUT, handle())
        == "engine differs: peer agent 'agent-p' has weights_sha256 'ab', this worker 'cd'"
    )


def test_descriptors_list_each_layer_side_and_block_in_one_order():
    region = KVRegion("data", 1000, pool_blocks=10, block_bytes=100)
    rows = block_descriptors([region], num_layers=2, block_ids=[3, 7])
    # plane (layer * 2 + side) p, block b: 1000 + (p * 10 + b) * 100
    assert rows[:, 0].tolist() == [1300, 1700, 2300, 2700, 3300, 3700, 4300, 4700]
    assert set(rows[:, 1].tolist()) == {100} and rows.dtype == np.uint64


def test_role_is_an_engine_setting_at_every_door():
    args = EngineArgs(role="decode", kv_pin_timeout_s=5)
    assert to_parameters(args) == {"role": "decode", "kv_pin_timeout_s": "5"}
    assert from_parameters({"role": "prefill"}).role == "prefill"
    with pytest.raises(ValueError, match=r"EngineArgs\.role must be one of both, prefill, decode"):
        EngineArgs(role="middle")
    with pytest.raises(ValueError, match="kv_pin_timeout_s"):
        EngineArgs(kv_pin_timeout_s=0)


# --- config and wire ---


def test_the_yaml_config_takes_prefill_and_decode_pools():
    config = GatewayConfig.from_dict({"backends": {"m": {
        "prefill": {"replicas": ["p0:8001", {"url": "p1:8001", "metrics_url": "http://p1:8002/metrics"}]},
        "decode": {"discover": {"host": "decode-headless"}}, "url": "both:8001"}}})  # fmt: skip
    backend = config.backends["m"]
    assert backend.disaggregated and [r.url for r in backend.prefill.configured_replicas] == ["p0:8001", "p1:8001"]
    assert backend.decode.discover.host == "decode-headless" and backend.url == "both:8001"
    gw = Gateway(config, GatewaySettings(), CollectorRegistry())
    assert set(gw.pools) == {"m", "m:prefill", "m:decode"}
    assert gw.pools["m:decode"].policy == "least_loaded" and gw.pools["m:prefill"].policy == "prefix"
    assert "m:decode" in gw.monitor.discover
    no_both = GatewayConfig.from_dict({"backends": {"m": {"prefill": "p:1", "decode": "d:1"}}})
    assert Gateway(no_both, GatewaySettings(), CollectorRegistry()).disagg["m"].both is None
    for broken, message in (({"prefill": "p:1"}, "backends.m.decode: a disaggregated backend needs both"),
                            ({"prefill": "p:1", "decode": {"bogus": 1}}, "backends.m.decode.bogus: unknown field"),
                            ({"prefill": "nope", "decode": "d:1"}, "backends.m.prefill.url: expected")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            GatewayConfig.from_dict({"backends": {"m": broken}})


def test_the_cli_wants_both_pools():
    result = CliRunner().invoke(gateway, ["--prefill-url", "127.0.0.1:1"])
    assert result.exit_code == 2 and "give --prefill-url and --decode-url together" in result.output
    result = CliRunner().invoke(gateway, ["--prefill-url", "a:1", "--decode-url", "b:1", "--decode-metrics-url", "x",
                                          "--decode-metrics-url", "y"])  # fmt: skip
    assert result.exit_code == 2 and "2 metrics URLs for 1 --decode-url" in result.output


def test_the_wire_carries_the_disaggregation_fields():
    request = GenerateRequest("hi", None, {"max_tokens": 3}, prefill_only=True)
    message = build_request("llm", request, stream=False)
    assert [i.name for i in message.inputs if i.name in ("prefill_only", "kv_handle")] == ["prefill_only"]
    assert "kv_handle" in [o.name for o in message.outputs]
    decode = build_request("llm", dataclasses.replace(request, prefill_only=False, kv_handle="{}"), stream=True)
    assert "kv_handle" in [i.name for i in decode.inputs] and "kv_handle" not in [o.name for o in decode.outputs]


def test_a_failed_read_is_a_503_that_keeps_the_decode_worker_in_routing():
    error = classify("kv transfer failed: handshake refused: KV layout differs", "m:decode")
    assert (error.status, error.code) == (503, KV_TRANSFER_CODE)


def test_parse_response_reads_the_handle():
    from tritonclient.grpc import service_pb2 as pb

    response = pb.ModelInferResponse()
    for name, raw in (("text_output", b"x"), ("finish_reason", b"handoff"), ("kv_handle", b"{}")):
        response.outputs.add(name=name, datatype="BYTES", shape=[1])
        response.raw_output_contents.append(len(raw).to_bytes(4, "little") + raw)
    for name in ("prompt_tokens", "completion_tokens"):
        response.outputs.add(name=name, datatype="INT32", shape=[1])
        response.raw_output_contents.append((1).to_bytes(4, "little"))
    assert parse_response(response).kv_handle == "{}"


# --- the flow, over fake upstreams ---


@dataclass
class Fake:
    """Answers `deltas` then raises `error`; records the requests it got."""

    deltas: list[Delta] = field(default_factory=list)
    error: GatewayError | None = None
    healthy: bool = True
    got: list[GenerateRequest] = field(default_factory=list)

    async def generate(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        self.got.append(request)
        for delta in self.deltas:
            yield delta
        if self.error is not None:
            raise self.error


HANDOFF = Delta("Hel", "handoff", 4, 1, kv_handle=handle().to_json())
DECODED = [Delta("lo", None, 4, 2), Delta("!", "length", 4, 3)]
OVERLOADED = GatewayError.overloaded("overloaded: no KV blocks free")
READ_FAILED = classify("kv transfer failed: the peer is gone", "d")


def run(prefill: list[Fake], decode: list[Fake], both: list[Fake]) -> tuple[list[str], GatewayError | None, dict]:
    metrics = GatewayMetrics.create(CollectorRegistry())
    routing = RoutingSettings(policy="round_robin", max_attempts=3)

    def make(name: str, fakes: list[Fake]) -> ReplicaPool:
        made = ReplicaPool(name, "llm", [Replica(f"{name}{i}:1") for i in range(len(fakes))], routing, "round_robin",
                           metrics)  # fmt: skip
        for replica, fake in zip(made.replicas.values(), fakes, strict=True):
            replica.upstream = fake  # type: ignore[assignment]
        return made

    config = GatewayConfig.from_dict({"backends": {"m": {"prefill": "p:1", "decode": "d:1"}}})
    gw = Gateway(config, GatewaySettings(), CollectorRegistry())
    disagg = dataclasses.replace(gw.disagg["m"], prefill=make("p", prefill), decode=make("d", decode),
                                 both=make("b", both) if both else None)  # fmt: skip
    pools = disagg.role_pools()

    request = [GenerateRequest("Hi", None, {})]
    texts, error = stream_exchange(
        lambda: Exchange(
            RouteDecision("m", EXPLICIT), pools, Router(config), request, True, False, disagg={"m": disagg}
        )
    )
    assert all(r.in_flight == 0 for p in pools.values() for r in p.replicas.values())  # every lease released
    outcomes = {s.labels["outcome"]: s.value for m in metrics.disagg.collect() for s in m.samples
                if s.name.endswith("_total")}  # fmt: skip
    return texts, error, outcomes


def test_prefill_then_decode_streams_the_first_token_first():
    prefill, decode = Fake([HANDOFF]), Fake(DECODED)
    texts, error, outcomes = run([prefill], [decode], [])
    assert (texts, error, outcomes) == (["Hel", "lo", "!"], None, {"decoded": 1.0})
    assert prefill.got[0].prefill_only and decode.got[0].kv_handle == HANDOFF.kv_handle


def test_a_request_that_ended_on_its_first_token_is_not_decoded():
    decode = Fake(DECODED)
    texts, _, outcomes = run([Fake([Delta("Hi", "length", 4, 1)])], [decode], [])
    assert texts == ["Hi"] and decode.got == [] and outcomes == {"prefill_finished": 1.0}


def test_a_prefill_worker_lost_before_the_handle_is_retried_elsewhere():
    lost = Fake(error=GatewayError.unavailable("backend 'p' is unreachable"))
    texts, error, _ = run([lost, Fake([HANDOFF])], [Fake(DECODED)], [])
    assert texts == ["Hel", "lo", "!"] and error is None


def test_an_overloaded_decode_worker_is_replaced_by_another():
    busy, fine = Fake(error=OVERLOADED), Fake(DECODED)
    texts, _, outcomes = run([Fake([HANDOFF])], [busy, fine], [])
    assert texts == ["Hel", "lo", "!"] and len(fine.got) == 1 and outcomes == {"decoded": 1.0}


def test_a_failed_read_is_recomputed_on_a_both_worker_never_read_twice():
    failed, other, both = Fake(error=READ_FAILED), Fake(DECODED), Fake(DECODED)
    texts, _, outcomes = run([Fake([HANDOFF])], [failed, other], [both])
    assert texts == ["Hel", "lo", "!"] and other.got == [] and outcomes == {"recomputed": 1.0}
    assert KVHandle.from_json(both.got[0].kv_handle).recompute


def test_without_both_workers_another_decode_worker_recomputes():
    failed, other = Fake(error=READ_FAILED), Fake(DECODED)
    texts, _, _ = run([Fake([HANDOFF])], [failed, other], [])
    assert texts == ["Hel", "lo", "!"] and KVHandle.from_json(other.got[0].kv_handle).recompute


def test_when_nothing_can_recompute_the_client_gets_a_clear_error():
    texts, error, outcomes = run([Fake([HANDOFF])], [Fake(error=READ_FAILED)], [Fake(error=READ_FAILED)])
    assert texts == ["Hel"] and error is not None and error.status == 503 and error.code == "decode_failed"
    assert "the first token was sent" in error.message and outcomes == {"failed": 1.0}


def test_a_decode_cut_after_its_first_delta_reaches_the_client():
    cut = Fake([DECODED[0]], error=GatewayError.unavailable("backend 'd' is unreachable"))
    both = Fake(DECODED)
    texts, error, _ = run([Fake([HANDOFF])], [cut], [both])
    assert texts == ["Hel", "lo"] and error is not None and both.got == []

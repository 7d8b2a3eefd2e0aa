"""The gateway's own Prometheus metrics (the queue and router register theirs in the same registry).

Per replica (labels backend, replica = its gRPC address): picks by reason, retries, health, in-flight
requests, and the engine load last scraped from the replica (what routing saw; the replicas export the
same values themselves, also under vLLM's names, for Prometheus, autoscalers and external routers).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REPLICA = ["backend", "replica"]
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class GatewayMetrics:
    requests: Counter
    latency: Histogram
    ttft: Histogram
    tokens: Counter
    cancelled: Counter
    backend_healthy: Gauge
    replica_picks: Counter
    replica_retries: Counter
    streams_resumed: Counter
    replica_healthy: Gauge
    replica_in_flight: Gauge
    replica_waiting: Gauge
    replica_running: Gauge
    replica_kv_usage: Gauge
    replica_index_chunks: Gauge
    disagg: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> GatewayMetrics:
        return cls(
            requests=Counter("trtserve_gateway_requests", "Requests answered, by endpoint, model and HTTP status",
                             ["endpoint", "model", "status"], registry=registry),
            latency=Histogram("trtserve_gateway_request_duration_seconds", "Arrival to the last byte",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry),
            ttft=Histogram("trtserve_gateway_time_to_first_token_seconds", "Arrival to the first streamed token",
                           ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry),
            tokens=Counter("trtserve_gateway_tokens", "Tokens by the engines' counts", ["model", "kind"],
                           registry=registry),
            cancelled=Counter("trtserve_gateway_cancelled",
                              "Requests whose client disconnected before the end (upstream cancelled)",
                              ["endpoint"], registry=registry),
            backend_healthy=Gauge("trtserve_gateway_backend_healthy", "1 if a replica of the backend is ready",
                                  ["backend"], registry=registry),
            replica_picks=Counter("trtserve_gateway_replica_picks", "Upstream requests sent to each replica, by reason",
                                  [*REPLICA, "reason"], registry=registry),
            replica_retries=Counter("trtserve_gateway_replica_retries",
                                    "Requests retried elsewhere after this replica failed before their first token",
                                    REPLICA, registry=registry),
            streams_resumed=Counter("trtserve_gateway_streams_resumed",
                                    "Streams cut by this replica's failure, resumed elsewhere (or once it was back)",
                                    REPLICA, registry=registry),
            replica_healthy=Gauge("trtserve_gateway_replica_healthy", "1 if the replica's model is ready", REPLICA,
                                  registry=registry),
            replica_in_flight=Gauge("trtserve_gateway_replica_in_flight", "Upstream requests open to the replica",
                                    REPLICA, registry=registry),
            replica_waiting=Gauge("trtserve_gateway_replica_waiting", "Engine waiting requests, as last scraped",
                                  REPLICA, registry=registry),
            replica_running=Gauge("trtserve_gateway_replica_running", "Engine running requests, as last scraped",
                                  REPLICA, registry=registry),
            replica_kv_usage=Gauge("trtserve_gateway_replica_kv_usage_ratio", "Engine KV-cache usage, as last scraped",
                                   REPLICA, registry=registry),
            replica_index_chunks=Gauge("trtserve_gateway_replica_prefix_index_chunks",
                                       "Prompt-prefix chunk hashes remembered for the replica", REPLICA,
                                       registry=registry),
            disagg=Counter("trtserve_gateway_disagg_requests",
                           "Disaggregated generations by outcome: decoded (prefill then decode), prefill_finished "
                           "(ended on its first token), recomputed (the KV could not be read: a worker recomputed "
                           "it), failed", ["backend", "outcome"], registry=registry),
        )  # fmt: skip

    def forget_replica(self, backend: str, replica: str) -> None:
        """Drop a removed replica's series (its picks and retries stay counted)."""
        for gauge in (self.replica_healthy, self.replica_in_flight, self.replica_waiting, self.replica_running,
                      self.replica_kv_usage, self.replica_index_chunks):  # fmt: skip
            with contextlib.suppress(KeyError):
                gauge.remove(backend, replica)

"""The gateway's own Prometheus metrics (the queue and router register theirs in the same registry)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class GatewayMetrics:
    requests: Counter
    latency: Histogram
    ttft: Histogram
    tokens: Counter
    cancelled: Counter
    backend_healthy: Gauge

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
            backend_healthy=Gauge("trtserve_gateway_backend_healthy", "1 if the backend's model is ready",
                                  ["backend"], registry=registry),
        )  # fmt: skip

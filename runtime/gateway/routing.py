"""Model routing: the gateway's config (backends, virtual models) and the policy picking a backend per request.

A backend is one tritonserver model clients can name directly. A virtual model is a name that routes
between two backends, `small` and `strong`:

- explicit: always `strong` (an alias; switching a routed name to it turns routing off without renaming).
- prompt_length: `small` when the prompt has at most `max_small_prompt_chars` characters, else `strong`.
  Characters, not tokens: the gateway runs without a tokenizer (it never loads the model), and for one
  model family characters per token are near-constant, so a character cut-off is a token cut-off.
- cascade: `small` answers first; when its mean token log-probability is below `cascade_threshold` (or
  unknown), `strong` answers instead. A streamed answer has already reached the client and cannot be
  re-answered, so streaming requests are pre-routed by prompt length instead (the reason says so).

A backend runs on one or more replicas (runtime/gateway/replica_config.py): the router names the backend,
the backend's replica pool (runtime/gateway/replicas.py) picks the tritonserver.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

from prometheus_client import CollectorRegistry, Counter

from runtime.gateway.config_file import read_file
from runtime.gateway.replica_config import (
    Discovery,
    Replica,
    ReplicaPolicy,
    RoleSource,
    RoutingSettings,
    check_policy,
    check_routing,
    check_sources,
    discovery_from,
    replicas_from,
    role_source_from,
    routing_from,
)
from runtime.gateway.tenants import Tenant, tenants_from

Policy = Literal["explicit", "prompt_length", "cascade"]
POLICIES: tuple[str, ...] = get_args(Policy)

# RouteDecision.reason values (also the `reason` label of the decisions counter).
EXPLICIT = "explicit"
SHORT_PROMPT = "short_prompt"
LONG_PROMPT = "long_prompt"
CASCADE = "cascade"
CASCADE_STREAM_SHORT_PROMPT = "cascade_stream_short_prompt"
CASCADE_STREAM_LONG_PROMPT = "cascade_stream_long_prompt"
ESCALATED = "escalated"  # recorded by the caller when a cascade's strong model answered


@dataclass(frozen=True)
class Backend:
    """A model clients name, served by replicas: exactly one of `url` (one replica), `replicas`, `discover`.

    Disaggregated (`prefill` and `decode` given): each request runs its prompt on a prefill worker, then decodes
    on a decode worker that reads the KV (runtime/gateway/disagg.py); the backend's own replicas, if any, are
    `both` workers that recompute a request whose KV could not be read."""

    name: str  # the OpenAI model name clients use
    url: str = ""  # tritonserver's gRPC host:port
    triton_model: str = "llm"
    replicas: tuple[Replica, ...] = ()
    discover: Discovery | None = None
    routing: ReplicaPolicy | None = None  # this backend's replica policy; None: the routing section's
    prefill: RoleSource | None = None  # tritonservers started with --role prefill
    decode: RoleSource | None = None  # tritonservers started with --role decode

    @property
    def configured_replicas(self) -> tuple[Replica, ...]:
        """The replicas listed in the config (none with `discover`: DNS supplies them at run time)."""
        return self.replicas or ((Replica(self.url),) if self.url else ())

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


@dataclass(frozen=True)
class VirtualModel:
    name: str
    policy: Policy
    small: str  # backend names
    strong: str
    max_small_prompt_chars: int = 2000  # about 500 tokens of English
    cascade_threshold: float = -1.0  # mean log-probability per token; below it, escalate


@dataclass(frozen=True)
class RouteDecision:
    model: str  # the backend to call
    reason: str
    escalate_to: str | None = None  # cascade: the backend to re-ask when should_escalate says so
    virtual_model: str | None = None  # the virtual model requested; None when the client named a backend


class UnknownModel(LookupError):
    """The requested name is neither a backend nor a virtual model (the gateway answers 404)."""

    def __init__(self, model: str, known: list[str]) -> None:
        super().__init__(f"unknown model {model!r}; served: {', '.join(known)}")
        self.model = model
        self.known = known


# Config file layout: top-level section -> the dataclass its entries build (keyed by name).
SECTIONS: dict[str, type[Backend] | type[VirtualModel]] = {"backends": Backend, "virtual_models": VirtualModel}


@dataclass(frozen=True)
class GatewayConfig:
    backends: dict[str, Backend]
    virtual: dict[str, VirtualModel] = field(default_factory=dict)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    tenants: tuple[Tenant, ...] = ()  # none: one key (--api-key) or none (runtime.gateway.tenants)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def models(self) -> list[str]:
        """Every name a client may request: backends, then virtual models."""
        return [*self.backends, *self.virtual]

    @classmethod
    def single(cls, name: str, url: str, triton_model: str = "llm") -> GatewayConfig:
        """One backend and no virtual models: the default without a config file."""
        return cls({name: Backend(name, url, triton_model)})

    @classmethod
    def load(cls, path: str | Path) -> GatewayConfig:
        """Read a .yaml/.yml or .toml file; ValueError (prefixed with the path) names what is wrong."""
        return read_file(path, cls.from_dict)

    def with_tenants(self, tenants: tuple[Tenant, ...]) -> GatewayConfig:
        """This config with tenants from elsewhere (`trtserve gateway --tenants`); ValueError if it has its own."""
        if self.tenants:
            raise ValueError("tenants are listed in the config already")
        return replace(self, tenants=tenants)

    @classmethod
    def from_dict(cls, data: object) -> GatewayConfig:
        """Build from parsed YAML/TOML: {"backends": {name: {...}}, "virtual_models": {name: {...}},
        "routing": {...}, "tenants": {name: {...}}}."""
        top = _mapping("config", {} if data is None else data)
        unknown = sorted(set(top) - {*SECTIONS, "routing", "tenants"})
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown section (expected {', '.join(SECTIONS)}, routing, tenants)")
        built: dict[str, dict[str, Any]] = {}
        for section, kind in SECTIONS.items():
            entries = _mapping(section, top.get(section, {}))
            built[section] = {
                name: kind(name=name, **_entry(f"{section}.{name}", entry, kind)) for name, entry in entries.items()
            }
        routing = routing_from("routing", top["routing"]) if "routing" in top else RoutingSettings()
        tenants = tenants_from("tenants", top["tenants"]) if "tenants" in top else ()
        return cls(built["backends"], built["virtual_models"], routing, tenants)


class Router:
    """Picks the backend for each request; counts decisions in trtserve_gateway_route_decisions_total.

    registry None: a private registry (counted, not exported).
    """

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self._decisions = Counter(
            "trtserve_gateway_route_decisions",
            "Upstream answers by requested model, backend and routing reason",
            ["virtual_model", "model", "reason"],
            registry=registry if registry is not None else CollectorRegistry(),
        )

    def route(self, model: str, prompt_chars: int, stream: bool) -> RouteDecision:
        """The backend for a request naming `model` with a prompt of `prompt_chars` characters."""
        if model in self.config.backends:
            return RouteDecision(model, EXPLICIT)
        virtual = self.config.virtual.get(model)
        if virtual is None:
            raise UnknownModel(model, self.config.models)
        short = prompt_chars <= virtual.max_small_prompt_chars
        by_length = virtual.small if short else virtual.strong
        if virtual.policy == "explicit":
            return RouteDecision(virtual.strong, EXPLICIT, None, model)
        if virtual.policy == "prompt_length":
            return RouteDecision(by_length, SHORT_PROMPT if short else LONG_PROMPT, None, model)
        if stream:
            reason = CASCADE_STREAM_SHORT_PROMPT if short else CASCADE_STREAM_LONG_PROMPT
            return RouteDecision(by_length, reason, None, model)
        escalate_to = virtual.strong if virtual.strong != virtual.small else None
        return RouteDecision(virtual.small, CASCADE, escalate_to, model)

    def should_escalate(self, decision: RouteDecision, mean_logprob: float | None) -> bool:
        """Whether a cascade's small answer should be replaced by `escalate_to`'s.

        Unknown confidence (None, NaN) escalates; decisions without `escalate_to` never do.
        """
        if decision.escalate_to is None:
            return False
        if decision.virtual_model not in self.config.virtual:
            raise ValueError(f"decision names no virtual model of this config: {decision!r}")
        if mean_logprob is None or math.isnan(mean_logprob):
            return True
        return mean_logprob < self.config.virtual[decision.virtual_model].cascade_threshold

    def record(self, model: str, reason: str, virtual_model: str | None = None) -> None:
        """Count one upstream answer from `model`; `virtual_model` is the name requested (default: `model`)."""
        self._decisions.labels(virtual_model or model, model, reason).inc()


def _mapping(path: str, value: object) -> dict[str, object]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{path}: expected a mapping of names, got {type(value).__name__}")
    return value


def _entry(path: str, entry: object, kind: type[Backend] | type[VirtualModel]) -> dict[str, Any]:
    """An entry's fields (its name is its key), with unknown and missing fields refused."""
    values = _mapping(path, entry)
    allowed = {f.name: f for f in fields(kind) if f.name != "name"}
    for key in values:
        if key not in allowed:
            raise ValueError(f"{path}.{key}: unknown field (expected {', '.join(allowed)})")
    for name, f in allowed.items():
        if name not in values and f.default is MISSING and f.default_factory is MISSING:
            raise ValueError(f"{path}.{name}: required field missing")
    if kind is Backend:  # nested entries become their dataclasses
        values = dict(values)
        if "replicas" in values:
            values["replicas"] = replicas_from(f"{path}.replicas", values["replicas"])
        if "discover" in values:
            values["discover"] = discovery_from(f"{path}.discover", values["discover"])
        for role in ("prefill", "decode"):
            if role in values:
                values[role] = role_source_from(f"{path}.{role}", values[role])
    return values


def _validate(config: GatewayConfig) -> None:
    if not config.backends:
        raise ValueError("backends: at least one backend is required")
    check_routing("routing", config.routing)
    for key, backend in config.backends.items():
        path = f"backends.{key}"
        _check_name(path, key, backend.name)
        if (backend.prefill is None) != (backend.decode is None):
            missing = "decode" if backend.decode is None else "prefill"
            raise ValueError(f"{path}.{missing}: a disaggregated backend needs both a prefill and a decode pool")
        check_sources(path, backend.url, backend.replicas, backend.discover, optional=backend.disaggregated)
        _check_str(f"{path}.triton_model", backend.triton_model)
        if backend.routing is not None:
            check_policy(f"{path}.routing", backend.routing)
    for key, virtual in config.virtual.items():
        path = f"virtual_models.{key}"
        _check_name(path, key, virtual.name)
        if key in config.backends:
            raise ValueError(f"{path}: {key!r} is also a backend's name; model names must be unique")
        if virtual.policy not in POLICIES:
            raise ValueError(f"{path}.policy: expected one of {', '.join(POLICIES)}, got {virtual.policy!r}")
        for role in ("small", "strong"):
            target = getattr(virtual, role)
            if target not in config.backends:
                known = ", ".join(config.backends)
                raise ValueError(f"{path}.{role}: {target!r} is not a backend (backends: {known})")
        limit = virtual.max_small_prompt_chars
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"{path}.max_small_prompt_chars: expected an integer >= 0, got {limit!r}")
        threshold = virtual.cascade_threshold
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not -math.inf < threshold <= 0:
            raise ValueError(f"{path}.cascade_threshold: expected a mean log-probability <= 0, got {threshold!r}")


def _check_name(path: str, key: object, name: object) -> None:
    _check_str(path, key)
    if name != key:
        raise ValueError(f"{path}.name: {name!r} differs from the name it is listed under")


def _check_str(path: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}: expected a non-empty string, got {value!r}")

"""Routing: each policy's choice and reason, cascade escalation, decision metrics, config files and their errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from runtime.gateway.routing import (
    CASCADE,
    CASCADE_STREAM_LONG_PROMPT,
    CASCADE_STREAM_SHORT_PROMPT,
    ESCALATED,
    EXPLICIT,
    LONG_PROMPT,
    SHORT_PROMPT,
    Backend,
    GatewayConfig,
    RouteDecision,
    Router,
    UnknownModel,
    VirtualModel,
)

YAML_CONFIG = """\
backends:
  smol-135m: {url: "localhost:8001"}
  smol-1.7b: {url: "gpu-2:8001", triton_model: llm_fp8}
virtual_models:
  auto: {policy: cascade, small: smol-135m, strong: smol-1.7b, max_small_prompt_chars: 100, cascade_threshold: -0.5}
  by-length: {policy: prompt_length, small: smol-135m, strong: smol-1.7b, max_small_prompt_chars: 100}
  pinned: {policy: explicit, small: smol-135m, strong: smol-1.7b}
"""

TOML_CONFIG = """\
[backends.smol-135m]
url = "localhost:8001"

[backends."smol-1.7b"]
url = "gpu-2:8001"
triton_model = "llm_fp8"

[virtual_models.auto]
policy = "cascade"
small = "smol-135m"
strong = "smol-1.7b"
max_small_prompt_chars = 100
cascade_threshold = -0.5

[virtual_models.by-length]
policy = "prompt_length"
small = "smol-135m"
strong = "smol-1.7b"
max_small_prompt_chars = 100

[virtual_models.pinned]
policy = "explicit"
small = "smol-135m"
strong = "smol-1.7b"
"""

SMALL, STRONG = "smol-135m", "smol-1.7b"


def config() -> GatewayConfig:
    return GatewayConfig(
        backends={SMALL: Backend(SMALL, "localhost:8001"), STRONG: Backend(STRONG, "gpu-2:8001", "llm_fp8")},
        virtual={
            "auto": VirtualModel("auto", "cascade", SMALL, STRONG, 100, -0.5),
            "by-length": VirtualModel("by-length", "prompt_length", SMALL, STRONG, 100),
            "pinned": VirtualModel("pinned", "explicit", SMALL, STRONG),
        },
    )


@pytest.mark.parametrize(
    ("model", "prompt_chars", "stream", "expected"),
    [
        (SMALL, 10_000, False, RouteDecision(SMALL, EXPLICIT)),
        (STRONG, 0, True, RouteDecision(STRONG, EXPLICIT)),
        ("pinned", 0, False, RouteDecision(STRONG, EXPLICIT, None, "pinned")),
        ("by-length", 100, False, RouteDecision(SMALL, SHORT_PROMPT, None, "by-length")),
        ("by-length", 101, False, RouteDecision(STRONG, LONG_PROMPT, None, "by-length")),
        ("by-length", 101, True, RouteDecision(STRONG, LONG_PROMPT, None, "by-length")),
        ("auto", 5000, False, RouteDecision(SMALL, CASCADE, STRONG, "auto")),
        ("auto", 100, True, RouteDecision(SMALL, CASCADE_STREAM_SHORT_PROMPT, None, "auto")),
        ("auto", 101, True, RouteDecision(STRONG, CASCADE_STREAM_LONG_PROMPT, None, "auto")),
    ],
)
def test_each_policy_picks_its_backend_with_the_reason(
    model: str, prompt_chars: int, stream: bool, expected: RouteDecision
) -> None:
    assert Router(config()).route(model, prompt_chars, stream) == expected


def test_unknown_model_is_refused_listing_the_served_names() -> None:
    with pytest.raises(UnknownModel, match="'gpt-4'") as caught:
        Router(config()).route("gpt-4", 10, False)
    assert caught.value.model == "gpt-4"
    assert caught.value.known == [SMALL, STRONG, "auto", "by-length", "pinned"]


@pytest.mark.parametrize(
    ("mean_logprob", "escalate"),
    [(-0.51, True), (-0.5, False), (-0.1, False), (0.0, False), (None, True), (math.nan, True), (-math.inf, True)],
)
def test_cascade_escalates_below_the_threshold_only(mean_logprob: float | None, escalate: bool) -> None:
    router = Router(config())
    decision = router.route("auto", 10, False)
    assert router.should_escalate(decision, mean_logprob) is escalate


def test_decisions_without_a_fallback_never_escalate() -> None:
    router = Router(config())
    for model, stream in ((SMALL, False), ("by-length", False), ("auto", True)):
        assert router.should_escalate(router.route(model, 10, stream), None) is False


def test_a_cascade_onto_the_same_backend_has_nothing_to_escalate_to() -> None:
    same = VirtualModel("same", "cascade", SMALL, SMALL)
    router = Router(GatewayConfig({SMALL: Backend(SMALL, "localhost:8001")}, {"same": same}))
    assert router.route("same", 10, False) == RouteDecision(SMALL, CASCADE, None, "same")


def test_a_decision_from_another_config_is_refused() -> None:
    foreign = RouteDecision(SMALL, CASCADE, STRONG, "elsewhere")
    with pytest.raises(ValueError, match="elsewhere"):
        Router(config()).should_escalate(foreign, -10.0)


def test_recorded_decisions_are_counted_by_requested_model_backend_and_reason() -> None:
    registry = CollectorRegistry()
    router = Router(config(), registry)
    router.record(SMALL, CASCADE, "auto")
    router.record(SMALL, CASCADE, "auto")
    router.record(STRONG, ESCALATED, "auto")
    router.record(SMALL, EXPLICIT)

    def count(virtual_model: str, model: str, reason: str) -> float | None:
        labels = {"virtual_model": virtual_model, "model": model, "reason": reason}
        return registry.get_sample_value("trtserve_gateway_route_decisions_total", labels)

    assert count("auto", SMALL, CASCADE) == 2.0
    assert count("auto", STRONG, ESCALATED) == 1.0
    assert count(SMALL, SMALL, EXPLICIT) == 1.0
    assert count("auto", STRONG, CASCADE) is None


@pytest.mark.parametrize(("suffix", "text"), [(".yaml", YAML_CONFIG), (".yml", YAML_CONFIG), (".toml", TOML_CONFIG)])
def test_config_files_load(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"gateway{suffix}"
    path.write_text(text)
    loaded = GatewayConfig.load(path)
    assert loaded == config()
    assert loaded.models == [SMALL, STRONG, "auto", "by-length", "pinned"]


def test_single_backend_default() -> None:
    single = GatewayConfig.single("smol", "localhost:8001")
    assert single == GatewayConfig({"smol": Backend("smol", "localhost:8001", "llm")}, {})
    assert Router(single).route("smol", 0, True) == RouteDecision("smol", EXPLICIT)
    with pytest.raises(ValueError, match=r"backends\.smol\.url"):
        GatewayConfig.single("smol", "http://localhost:8001/")


BACKENDS = 'backends:\n  a: {url: "h:1"}\n  b: {url: "h:2"}\n'


def virtual(**fields: object) -> str:
    entry = {"policy": "cascade", "small": "a", "strong": "b", **fields}
    return BACKENDS + "virtual_models:\n  v: {" + ", ".join(f"{k}: {v}" for k, v in entry.items()) + "}\n"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (virtual(strong="c"), r"virtual_models\.v\.strong: 'c' is not a backend \(backends: a, b\)"),
        (virtual(small="v"), r"virtual_models\.v\.small: 'v' is not a backend"),
        (virtual(policy="random"), r"virtual_models\.v\.policy: expected one of explicit, prompt_length, cascade"),
        (virtual(cascade_threshold=0.5), r"virtual_models\.v\.cascade_threshold: expected a mean log-probability"),
        (virtual(cascade_threshold='"-1"'), r"virtual_models\.v\.cascade_threshold"),
        (virtual(max_small_prompt_chars=-1), r"virtual_models\.v\.max_small_prompt_chars: expected an integer >= 0"),
        (virtual(max_small_prompt_chars="true"), r"virtual_models\.v\.max_small_prompt_chars"),
        (virtual(treshold=-1), r"virtual_models\.v\.treshold: unknown field"),
        (
            BACKENDS + "virtual_models:\n  a: {policy: cascade, small: a, strong: b}\n",
            r"virtual_models\.a: 'a' is also",
        ),
        (BACKENDS + "virtual_models:\n  v: {small: a, strong: b}\n", r"virtual_models\.v\.policy: required"),
        (BACKENDS + "  a: {url: 'h:3'}\n", r"found duplicate key 'a'"),
        ("backends:\n  a: {triton_model: llm}\n", r"backends\.a\.url: required field missing"),
        ("backends:\n  a: {url: localhost}\n", r"backends\.a\.url: expected tritonserver's gRPC host:port"),
        ("backends:\n  a: {url: 'h:0'}\n", r"backends\.a\.url"),
        ("backends:\n  a: {url: 'h:1', triton_model: ''}\n", r"backends\.a\.triton_model: expected a non-empty"),
        ("backends:\n  a: {url: 'h:1', name: b}\n", r"backends\.a\.name: unknown field"),
        ("backends:\n  a: h:1\n", r"backends\.a: expected a mapping"),
        ("backends: {}\n", r"backends: at least one backend is required"),
        ("", r"backends: at least one backend is required"),
        (BACKENDS + "virtuals: {}\n", r"virtuals: unknown section"),
        ("backends: [a, b]\n", r"backends: expected a mapping of names, got list"),
        ("backends: {a: {url: 'h:1'}\n", r"invalid YAML"),
    ],
)
def test_bad_yaml_configs_name_the_field(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error) as caught:
        GatewayConfig.load(path)
    assert str(caught.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[backends.a]\nurl = "h:1"\n[backends.a]\nurl = "h:2"\n', r"twice"),
        ('[backends.a]\nurl = "h:1"\n[virtual_models.v]\npolicy = "cascade"\nsmall = "a"\nstrong = "x"\n', r"strong"),
    ],
)
def test_bad_toml_configs_are_refused(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        GatewayConfig.load(path)


def test_unknown_config_format_is_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown config format '\.json'"):
        GatewayConfig.load(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError):
        GatewayConfig.load(tmp_path / "missing.yaml")


def test_programmatic_configs_are_validated_too() -> None:
    with pytest.raises(ValueError, match=r"backends\.x\.name: 'y' differs"):
        GatewayConfig({"x": Backend("y", "h:1")})
    with pytest.raises(ValueError, match=r"virtual_models\.v\.strong"):
        GatewayConfig({"a": Backend("a", "h:1")}, {"v": VirtualModel("v", "cascade", "a", "missing")})

"""The gateway's pure parts, without a server: request validation and its error paths, the
fan-out into upstream requests, and how the model's error messages map to HTTP statuses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runtime.gateway.errors import GatewayError, from_validation
from runtime.gateway.protocol import ChatCompletionRequest, CompletionRequest
from runtime.gateway.service import tenant_cache_salt
from runtime.gateway.upstream import classify
from runtime.gateway.wire import build_request, parse_logprobs

HI = [{"role": "user", "content": "hi"}]


def error_of(schema, body: dict) -> GatewayError:
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        return from_validation(exc)
    except GatewayError as exc:
        return exc
    pytest.fail(f"accepted: {body}")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": HI}, "model", "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text", "invalid_value"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name",
         "unknown_parameter"),
        ({"model": "m", "messages": HI, "stop": ["ok", 3]}, "stop[1]", "invalid_value"),
        ({"model": "m", "messages": HI, "stop": ""}, "stop", "invalid_value"),
        ({"model": "m", "messages": HI, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"model": "m", "messages": HI, "seed": -1}, "seed", "invalid_value"),
        ({"model": "m", "messages": HI, "max_tokens": 4, "max_completion_tokens": 4}, "max_tokens", None),
        ({"model": "m", "messages": HI, "temperature": True}, "temperature", "invalid_value"),  # bool is no number
    ],
)  # fmt: skip
def test_chat_validation_names_the_parameter(body, param, code):
    error = error_of(ChatCompletionRequest, body)
    assert (error.status, error.param, error.code) == (400, param, code)


def test_null_means_not_sent():
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "tools": None, "seed": None})
    assert request.seed is None and request.temperature == 1.0  # OpenAI's default


def test_upstream_requests_fan_out_with_consecutive_seeds():
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 10, "stop": "x", "logprobs": 1, "top_k": 3}
    requests = CompletionRequest.model_validate(body).upstream_requests()
    assert [(r.prompt, r.params["seed"]) for r in requests] == [("a", 10), ("a", 11), ("b", 10), ("b", 11)]
    assert all(r.stop == ("x",) and r.params["logprobs"] == 1 and r.params["top_k"] == 3 for r in requests)
    assert requests[0].params["max_tokens"] == 16  # OpenAI's default for completions
    assert error_of(CompletionRequest, {**body, "n": 9}).param == "n"  # 2 prompts x 9 > 16 choices


def test_chat_requests_carry_messages_and_optional_fields_only_when_given():
    body = {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be "},
            {"type": "text", "text": "brief"}]}, *HI]}  # fmt: skip
    [request] = ChatCompletionRequest.model_validate(body).upstream_requests()
    assert request.prompt is None and request.messages == [{"role": "system", "content": "be brief"}, *HI]
    assert "max_tokens" not in request.params and "logprobs" not in request.params and "seed" not in request.params
    with_logprobs = ChatCompletionRequest.model_validate({**body, "logprobs": True}).upstream_requests()
    assert with_logprobs[0].params["logprobs"] == 0  # the sampled token's logprob, no alternatives


@pytest.mark.parametrize(
    ("message", "status", "param"),
    [
        ("overloaded: 200 requests already waiting; retry later", 429, None),
        ("max_tokens: prompt (601 tokens) + max_tokens (4) = 605 exceeds the engine's max sequence length", 400,
         "max_tokens"),
        ("text_input: is not valid UTF-8", 400, "prompt"),
        ("engine error: step failed", 500, None),
        ("internal error: KeyError: 'x'", 500, None),
        ("Request for unknown model: 'llm' is not found", 503, None),
        ("something unexpected", 400, None),
    ],
)  # fmt: skip
def test_upstream_errors_map_to_statuses(message, status, param):
    error = classify(message, "b")
    assert (error.status, error.param) == (status, param)
    assert message in error.message


def test_latency_targets_pass_through_and_the_cache_salt_is_the_tenants():
    body = {"model": "m", "messages": HI, "ttft_target_s": 0.5, "itl_target_s": 0.125, "cache_salt": "team-b"}
    [request] = ChatCompletionRequest.model_validate(body).upstream_requests("tenant-salt")
    assert (request.params["ttft_target_s"], request.params["itl_target_s"]) == (0.5, 0.125)
    assert request.cache_salt == "tenant-salt"  # the body's own salt only reaches upstream through the tenant's
    assert error_of(ChatCompletionRequest, {**body, "itl_target_s": float("inf")}).param == "itl_target_s"
    assert error_of(ChatCompletionRequest, {**body, "cache_salt": "x" * 257}).param == "cache_salt"


def test_tenant_cache_salt_hides_the_key_and_never_equals_another_tenants():
    salts = {tenant_cache_salt(key, client) for key in ("key-a", "key-b", None) for client in (None, "x", "y")}
    assert len(salts) == 9 and None in salts  # None: no key and no client salt, the shared cache
    assert all("key-a" not in (s or "") for s in salts) and tenant_cache_salt("k", "x") == tenant_cache_salt("k", "x")


def test_inputs_are_typed_by_the_models_table():
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "seed": 2**40, "ttft_target_s": 0.5, "stop": ["a", "b"]}
    [request] = CompletionRequest.model_validate(body).upstream_requests("salt")
    types = {t.name: (t.datatype, list(t.shape)) for t in build_request("llm", request, stream=True).inputs}
    assert types["max_tokens"] == ("INT64", [1]) and types["seed"] == ("INT64", [1]) and types["top_k"][0] == "INT64"
    assert types["ttft_target_s"] == ("FP32", [1]) and types["stream"] == ("BOOL", [1])
    assert types["cache_salt"] == ("BYTES", [1]) and types["stop"] == ("BYTES", [2]) and "messages" not in types


def test_sizes_are_bounded_before_the_engine_sees_them():
    assert error_of(CompletionRequest, {"model": "m", "prompt": "x" * (10_485_760 + 1)}).param == "prompt"
    long_chat = [{"role": "user", "content": "x" * 6_000_000}] * 2  # each short enough, together too long
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": long_chat}).code == "prompt_too_long"
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": HI, "stop": ["s"] * 17}).param == "stop"


def test_logprobs_json_parses_with_or_without_token_text():
    raw = b'[{"token_id": 5, "logprob": -0.5, "top": [[5, -0.5], [7, -1.5]]}, {"token_id": 9, "token": "hi", ' \
          b'"logprob": -0.1, "top": []}]'  # fmt: skip
    first, second = parse_logprobs(raw)
    assert (first.token, first.logprob, first.top) == ("token_id:5", -0.5, [("token_id:5", -0.5), ("token_id:7", -1.5)])
    assert (second.token_id, second.token) == (9, "hi")

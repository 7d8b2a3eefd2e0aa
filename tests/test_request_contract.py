"""The request contract (engine_format/requests.py) walked through both doors: every field's bounds are
refused, and its edges accepted, by the OpenAI gateway's body model, by the Triton model's parser and by
SamplingParams alike, with the field named; a request the gateway accepts reaches the Triton parser,
through the gateway's wire encoding, as the same SamplingParams; each door's defaults are the contract's.
No server: the gateway's protobuf is decoded here as Triton hands inputs to the Python backend."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from engine_format.requests import FIELD, SAMPLING_FIELDS, InvalidRequest, Kind, Range, RequestField
from executors.sampling import SamplingParams
from runtime.gateway.errors import GatewayError, from_validation
from runtime.gateway.protocol import ChatCompletionRequest, CompletionRequest
from runtime.gateway.wire import build_request
from runtime.triton_model.inputs import NUMPY_TYPES, parse_request

HI = [{"role": "user", "content": "hi"}]
# Fields the OpenAI door names otherwise, or takes from elsewhere (the tenant sets cache_salt).
OPENAI_NAMES = {"logprobs": "top_logprobs"}
NOT_IN_OPENAI_BODY = {"stream_interval"}


def numeric(field: RequestField) -> bool:
    return field.kind in (Kind.INT, Kind.FLOAT) and field.range is not None


def outside(field: RequestField) -> list[Any]:
    """Values just past each end of the field's range."""
    assert field.range is not None
    step = 1 if field.kind is Kind.INT else 1e-3
    values = []
    if field.range.lo is not None:
        values.append(field.range.lo if field.range.lo_open else field.range.lo - step)
    if field.range.hi is not None:
        values.append(field.range.hi if field.range.hi_open else field.range.hi + step)
    return values


def edges(field: RequestField) -> list[Any]:
    """The range's own ends (just inside an open one)."""
    assert field.range is not None
    values = []
    if field.range.lo is not None:
        values.append(field.range.lo + (1e-3 if field.range.lo_open else 0))
    if field.range.hi is not None:
        values.append(field.range.hi)
    return [int(v) if field.kind is Kind.INT else float(v) for v in values]


def triton_inputs(values: dict[str, Any]) -> dict[str, np.ndarray]:
    arrays = {"text_input": np.array([b"hi"], dtype=np.object_)}
    for name, value in values.items():
        dtype = NUMPY_TYPES[FIELD[name].triton_type]
        arrays[name] = np.array([value], dtype=dtype)
    return arrays


def openai_body(values: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": HI}
    for name, value in values.items():
        body[OPENAI_NAMES.get(name, name)] = value
        if name == "logprobs":
            body["logprobs"] = True
    return body


NUMERIC = [f for f in SAMPLING_FIELDS if numeric(f) and f.name not in NOT_IN_OPENAI_BODY | {"cache_salt"}]


def gateway_error(body: dict[str, Any]) -> str | None:
    """The parameter the gateway's 400 names for `body` (None: accepted)."""
    try:
        ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        return from_validation(exc).param
    except GatewayError as exc:
        return exc.param
    return None


def walk_bounds(field: RequestField) -> None:
    """Each door refuses the values past `field`'s range, naming it, and accepts its edges."""
    for value in outside(field):
        with pytest.raises(InvalidRequest) as engine:
            SamplingParams(**{field.name: value})
        assert engine.value.field == field.name
        with pytest.raises(InvalidRequest) as triton:
            parse_request(triton_inputs({field.name: value}))
        assert triton.value.field == field.name
        assert gateway_error(openai_body({field.name: value})) == OPENAI_NAMES.get(field.name, field.name), value
    for value in edges(field):
        if field.kind is Kind.FLOAT and field.triton_type == "FP32" and not math.isclose(np.float32(value), value):
            continue  # not representable on the wire
        SamplingParams(**{field.name: value})
        parse_request(triton_inputs({field.name: value}))
        assert gateway_error(openai_body({field.name: value})) is None, value


@pytest.mark.parametrize("field", NUMERIC, ids=lambda f: f.name)
def test_every_numeric_field_has_the_same_bounds_at_every_door(field):
    walk_bounds(field)


@pytest.mark.parametrize("bounds", [Range(0.0, 3.0), Range(0.5, 2.0)])
def test_the_walk_catches_doors_that_disagree_with_a_field(bounds):
    """Had a door kept other bounds than the contract's, the walk fails: here the doors keep [0, 2] and
    the field the walk is given says otherwise."""
    with pytest.raises((InvalidRequest, AssertionError, pytest.fail.Exception)):
        walk_bounds(dataclasses.replace(FIELD["temperature"], range=bounds))


@pytest.mark.parametrize("door", ["triton", "openai"])
def test_each_door_defaults_to_the_contract(door):
    if door == "triton":
        params = parse_request(triton_inputs({})).params
    else:
        [upstream] = ChatCompletionRequest.model_validate({"model": "m", "messages": HI}).upstream_requests()
        params = parse_request(_decoded(upstream)).params
    for field in SAMPLING_FIELDS:
        if field.name in NOT_IN_OPENAI_BODY | {"cache_salt"}:
            continue
        assert getattr(params, field.name) == field.default_for(door), (door, field.name)


def test_completions_default_to_16_tokens_as_openai():
    [upstream] = CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).upstream_requests()
    assert upstream.params["max_tokens"] == 16


def test_a_request_reaches_the_triton_parser_as_the_same_sampling_params():
    body = {"model": "m", "messages": HI, "max_tokens": 7, "temperature": 0.5, "top_p": 0.75, "top_k": 3,
            "min_p": 0.125, "seed": 2**40, "stop": ["end", "fin"], "presence_penalty": -1.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.25, "priority": -3, "ignore_eos": True,
            "ttft_target_s": 0.5, "itl_target_s": 0.25, "logprobs": True, "top_logprobs": 4}  # fmt: skip
    [upstream] = ChatCompletionRequest.model_validate(body).upstream_requests(cache_salt="tenant-salt")
    parsed = parse_request(_decoded(upstream))
    assert parsed.prompt == HI
    expected = {name: body[name] for name in body if name in FIELD and FIELD[name].sampling}
    expected.update(logprobs=4, stop=("end", "fin"), cache_salt="tenant-salt")
    assert {name: getattr(parsed.params, name) for name in expected} == expected


def _decoded(upstream) -> dict[str, np.ndarray]:
    """The gateway's ModelInferRequest as the Python backend gets its inputs (BYTES as bytes objects)."""
    message = build_request("llm", upstream, stream=False)
    arrays = {}
    for spec, raw in zip(message.inputs, message.raw_input_contents, strict=True):
        if spec.datatype == "BYTES":
            values, offset = [], 0
            while offset < len(raw):
                size = int.from_bytes(raw[offset : offset + 4], "little")
                values.append(raw[offset + 4 : offset + 4 + size])
                offset += 4 + size
            arrays[spec.name] = np.array(values, dtype=np.object_)
        else:
            arrays[spec.name] = np.frombuffer(raw, dtype=NUMPY_TYPES[spec.datatype])
    arrays.pop("stream", None)
    return arrays

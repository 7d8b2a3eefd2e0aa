"""OpenAI's Responses API through the official `openai` SDK (`client.responses`), against a live gateway with
two tenants and a tritonserver serving the slow random Llama (8192 positions: the tools' system prompt fits).

Each Responses turn is checked against the chat completion it means, through the same gateway (the chat path is
checked against the offline engine in tests/test_gateway.py): greedy text and usage equal, for instructions, a
previous_response_id conversation and a function call round trip. Streams: the events in OpenAI's order with
consecutive sequence numbers, deltas that add up to the unstreamed answer, the SDK's stream helper. text.format
obeys its schema. A response is kept for its tenant only (another tenant's id is a 404), store=false keeps
nothing, DELETE drops it. Bad bodies are 400s (404s) naming the field, before any generation.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import yaml

from tests.gateway_helpers import build_slow_engine, client, gateway_metrics, running_gateway
from tests.triton_helpers import running_server

pytestmark = pytest.mark.serving
ALICE, BOB = "sk-alice-responses-0123", "sk-bob-responses-0123"
MODEL = "slow"
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "kind": {"enum": ["a", "b"]}},
    "required": ["id", "kind"],
}


@pytest.fixture(scope="module")
def gateway(engines_dir, tmp_path_factory):
    engine = build_slow_engine(engines_dir)
    with running_server(engine) as triton:
        config = {
            "backends": {MODEL: {"url": f"127.0.0.1:{triton.config.grpc_port}"}},
            "tenants": {"alice": {"key": ALICE}, "bob": {"key": BOB}},
        }
        path = tmp_path_factory.mktemp("responses") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        with running_gateway(None, None, "--config", str(path)) as gw:
            yield gw


@pytest.fixture(scope="module")
def alice(gateway) -> openai.OpenAI:
    return client(gateway.url, ALICE)


@pytest.fixture(scope="module")
def bob(gateway) -> openai.OpenAI:
    return client(gateway.url, BOB)


def chat_answer(sdk: openai.OpenAI, messages: list[dict], **kwargs):
    """The chat completion a Responses turn means (max_output_tokens is chat's max_completion_tokens)."""
    params = {"temperature": 0.0, "max_completion_tokens": 12, **kwargs}
    return sdk.chat.completions.create(model=MODEL, messages=messages, **params)


def test_text_input_with_instructions_is_the_chat_answer(alice):
    response = alice.responses.create(model=MODEL, input="Tell me a story", instructions="Be brief.", **GREEDY)
    chat = chat_answer(
        alice, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    )
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.instructions == "Be brief." and response.max_output_tokens == 12 and response.model == MODEL
    assert alice.responses.retrieve(response.id).model_dump() == response.model_dump()


def test_max_output_tokens_ends_incomplete(alice):
    response = alice.responses.create(
        model=MODEL, input="Once upon", temperature=0.0, max_output_tokens=3, extra_body=None
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_stream_events_in_order_add_up_to_the_answer(alice):
    whole = alice.responses.create(model=MODEL, input="Count to five", **GREEDY)
    events = list(alice.responses.create(model=MODEL, input="Count to five", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text and len(deltas) > 1
    assert events[2].item.id == final.output[0].id == events[-2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id != whole.id
    # The SDK's helper (it needs the answer to end on its own: it takes response.completed as the only end).
    text = {"format": {"type": "json_schema", "name": "plate", "schema": SCHEMA}}
    done = alice.responses.create(model=MODEL, input="A plate", text=text, temperature=0.0, max_output_tokens=40)
    with alice.responses.stream(model=MODEL, input="A plate", text=text, temperature=0.0, max_output_tokens=40) as s:
        assert s.get_final_response().output_text == done.output_text and done.status == "completed"


def test_previous_response_id_carries_the_conversation(alice):
    first = alice.responses.create(model=MODEL, input="Hello there", instructions="Only this turn.", **GREEDY)
    second = alice.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, **GREEDY)
    messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]  # instructions are not carried over (OpenAI's rule)
    chat = chat_answer(alice, messages)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id


def test_a_function_call_round_trip(alice):
    call = alice.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_output_tokens=200,
    )
    calls = call.output
    assert call.status == "completed" and [c.type for c in calls] == ["function_call"]
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    result = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 21}'} for c in calls]
    answer = alice.responses.create(model=MODEL, previous_response_id=call.id, input=result, tools=[WEATHER], **GREEDY)
    tool_calls = [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        *({"role": "tool", "tool_call_id": c.call_id, "content": '{"temp": 21}'} for c in calls),
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = chat_answer(alice, messages, tools=chat_tools)
    assert answer.output_text == (chat.choices[0].message.content or "")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    # The same call fed back as input items (no stored state) is the same conversation.
    fed = [{"role": "user", "content": "Weather in Oslo?"}, *(c.model_dump(exclude_none=True) for c in calls), *result]
    again = alice.responses.create(model=MODEL, input=fed, tools=[WEATHER], store=False, **GREEDY)
    assert again.output_text == answer.output_text


def test_a_streamed_call_arrives_name_first_then_arguments(alice):
    params = {
        "model": MODEL,
        "input": "Weather in Oslo?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0.0,
        "max_output_tokens": 200,
    }
    whole = alice.responses.create(**params)
    events = list(alice.responses.create(**params, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == [i.type for i in whole.output] and added[0].name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(pieces) == done.arguments == events[-1].response.output[0].arguments
    assert json.loads(done.arguments) == json.loads(whole.output[0].arguments)


def test_text_format_json_schema_is_obeyed(alice):
    text = {"format": {"type": "json_schema", "name": "plate", "schema": SCHEMA, "strict": True}}
    response = alice.responses.create(model=MODEL, input="A plate", text=text, temperature=0.0, max_output_tokens=40)
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema" and response.text.format.name == "plate"


def test_responses_are_kept_per_tenant(alice, bob):
    mine = alice.responses.create(model=MODEL, input="Hi", **GREEDY)
    with pytest.raises(openai.NotFoundError) as err:
        bob.responses.retrieve(mine.id)
    assert mine.id in err.value.message  # the same answer as for an id never issued
    with pytest.raises(openai.NotFoundError) as err:
        bob.responses.create(model=MODEL, input="Hi", previous_response_id=mine.id, **GREEDY)
    assert err.value.body["param"] == "previous_response_id"
    assert alice.responses.retrieve(mine.id).id == mine.id
    alice.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(mine.id)
    unstored = alice.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]", "'message' (the default)"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
            "input_text",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "required"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input[0].call_id",
            "no function call",
        ),
        ({"input": "Hi", "previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
        ({"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include", "not supported"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
        ({"input": "Hi", "truncation": "auto"}, "truncation", "disabled"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs"),
        (
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format.schema",
            "",
        ),
        (
            {"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
            "tool_choice.name",
            "other",
        ),
        ({"input": []}, "input", ""),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(gateway, alice, body, param, says):
    before = gateway_metrics(gateway).get('trtserve_gateway_tokens_total{model="slow",type="completion"}', 0.0)
    with pytest.raises(openai.APIStatusError) as err:
        alice.responses.create(model=MODEL, **body)
    assert err.value.status_code == (404 if param == "previous_response_id" else 400)
    assert err.value.body["param"] == param and says in err.value.message, err.value.body
    assert gateway_metrics(gateway).get('trtserve_gateway_tokens_total{model="slow",type="completion"}', 0.0) == before

"""Structured output as a user runs it: the openai SDK against `trtserve serve` (tiny Llama, one server for
the module). response_format and guided_* outputs obey their schema, regex or choices; a forced tool call
names its function with valid arguments, streamed name first and arguments in pieces that reassemble to the
unstreamed answer; auto answers in text or a call; a conversation with a tool result goes on; a bad schema is
a 400 naming it; the Triton door takes the same fields; the grammar metrics are exported. (A random model:
what it writes is the grammar's doing alone.)"""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_helpers import build_slow_engine, client
from tests.test_gateway_serve import Serve
from tests.triton_helpers import wait_for

pytestmark = pytest.mark.serving
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "kind": {"enum": ["a", "b"]}, "note": {"type": "string", "maxLength": 8}},
          "required": ["id", "kind", "note"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"]}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def served(engines_dir):
    """The random-weight Llama with 2048 positions: the tools' system prompt alone is ~700 tiny-tokenizer tokens."""
    engine = build_slow_engine(engines_dir)
    serve = Serve(engine)
    try:
        serve.output_until("OpenAI")
        yield serve, client(f"http://127.0.0.1:{serve.ports['openai']}"), engine.name
    finally:
        assert serve.stop() == 0


def chat(sdk: openai.OpenAI, model: str, **kwargs):
    return sdk.chat.completions.create(model=model, messages=kwargs.pop("messages", ASK), temperature=0,
                                       max_tokens=kwargs.pop("max_tokens", 120), **kwargs)  # fmt: skip


def streamed(sdk: openai.OpenAI, model: str, **kwargs) -> tuple[str, list[list[str]], str | None, list[dict]]:
    """(content, [[name, arguments] per call], finish reason, the tool-call deltas as they came)."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in chat(sdk, model, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            deltas.append(call.model_dump(exclude_none=True))
            if call.id is not None:
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, list(calls.values()), finish, deltas


def test_response_format_json_schema_is_obeyed_whole_and_streamed(served):
    _, sdk, model = served
    form = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    reply = chat(sdk, model, response_format=form)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    assert streamed(sdk, model, response_format=form)[0] == reply.choices[0].message.content
    anything = chat(sdk, model, response_format={"type": "json_object"}, max_tokens=200)
    text = anything.choices[0].message.content
    assert text.startswith("{")
    if anything.choices[0].finish_reason == "stop":  # a random model may write on past max_tokens
        assert isinstance(json.loads(text), dict)


def test_guided_extras_are_obeyed(served):
    _, sdk, model = served
    assert chat(sdk, model, extra_body={"guided_choice": ["red", "green"]}).choices[0].message.content in (
        "red", "green")  # fmt: skip
    text = sdk.completions.create(model=model, prompt="Code:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"}).choices[0].text  # fmt: skip
    assert len(text) == 7 and text[:3].isupper() and text[3] == "-" and text[4:].isdigit()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_tool_call_names_its_function_with_valid_arguments(served, choice):
    _, sdk, model = served
    reply = chat(sdk, model, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "add"
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    content, calls, finish, deltas = streamed(sdk, model, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert (content, calls, finish) == ("", [[call.function.name, call.function.arguments]], "tool_calls")
    assert deltas[0]["function"] == {"name": call.function.name, "arguments": ""} and "id" in deltas[0]
    assert len(deltas) > 2 and all("id" not in d and "name" not in d["function"] for d in deltas[1:])


def test_auto_answers_in_text_or_a_call_and_takes_the_result_back(served):
    _, sdk, model = served
    reply = chat(sdk, model, tools=TOOLS, max_tokens=40)
    message = reply.choices[0].message
    names = {t["function"]["name"] for t in TOOLS}
    assert message.content or message.tool_calls
    assert all(c.function.name in names for c in message.tool_calls or [])
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}]  # fmt: skip
    after = chat(sdk, model, messages=turns, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert after.choices[0].message.tool_calls is None and after.usage.prompt_tokens > 40


def test_a_bad_schema_is_a_400_naming_it(served):
    _, sdk, model = served
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}}
    with pytest.raises(openai.BadRequestError) as error:
        chat(sdk, model, response_format=form)
    assert error.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as error:
        chat(sdk, model, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "mul"}})
    assert error.value.body["param"] == "tool_choice.function.name"


def test_the_triton_door_takes_the_same_fields_and_metrics_count_them(served):
    serve, _, _ = served
    body = {"text_input": "Pick:", "guided_choice": ["left", "right"], "max_tokens": 8}
    request = urllib.request.Request(
        f"http://127.0.0.1:{serve.ports['http']}/v2/models/llm/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert answer["text_output"] in ("left", "right")
    bad = json.dumps({"text_input": "x", "guided_json": "{not json"}).encode()
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(request.full_url, data=bad), timeout=60)
    assert error.value.code == 400 and b"guided_json: is not valid JSON" in error.value.read()

    def metrics() -> dict[str, float]:
        url = f"http://127.0.0.1:{serve.ports['metrics']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("trtserve_grammar") and "_bucket" not in s.name}  # fmt: skip

    # The model publishes its metrics every 0.5 s: wait for the count to include this request.
    assert wait_for(lambda: metrics().get("trtserve_grammar_requests_total", 0) >= 1, timeout_s=30), metrics()
    values = metrics()
    assert values["trtserve_grammar_masked_steps_total"] >= 1 and values["trtserve_grammar_compile_seconds_count"] >= 1
    assert values["trtserve_grammar_compile_failures_total"] == 0  # the bad one never reached the engine's compiler

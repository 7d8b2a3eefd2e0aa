"""Structured output on a real model (SmolLM2-135M), with the openai SDK against `trtserve serve`: 20 held-out
JSON schemas (tests/data/structured_schemas.json: nested objects, arrays, enums, numbers with ranges, required
fields) all answered with JSON that parses and validates; a forced tool call names the function with valid
arguments; `auto` answers in text or a call; streamed answers reassemble to the whole ones; and greedy
constrained output is the same with n-gram speculation as without.

Each prompt shows the schema in a system message, as clients of small models do: the grammar guarantees the
shape, the prompt helps the model fill it (without it, 2 of the 20 answers looped inside a string until
max_tokens: valid so far, but cut off)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from runtime import LLM, SamplingParams
from tests.gateway_helpers import client
from tests.helpers import FLOAT32_BACKEND
from tests.test_gateway_serve import Serve

pytestmark = [pytest.mark.slow, pytest.mark.serving]
SCHEMAS = json.loads((Path(__file__).parent / "data" / "structured_schemas.json").read_text())
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius",
     "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
     "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]  # fmt: skip
WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def messages(entry: dict) -> list[dict[str, str]]:
    system = "Reply with a JSON object that matches this JSON schema: " + json.dumps(entry["schema"])
    return [{"role": "system", "content": system}, {"role": "user", "content": entry["prompt"]}]


def response_format(entry: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}


@pytest.fixture(scope="module")
def served(smollm2_engine):
    # float32: greedy JSON whose batches form as requests arrive; cpu-int8 (this engine's default on int8 CPUs)
    # rounds differently with the prefill chunks a batch gets, and one held-out schema's answer looped to max_tokens
    serve = Serve(smollm2_engine, "--backend", FLOAT32_BACKEND)
    try:
        serve.output_until("OpenAI", timeout_s=300)
        yield client(f"http://127.0.0.1:{serve.ports['openai']}"), smollm2_engine.name
    finally:
        assert serve.stop() == 0


def test_every_held_out_schema_is_answered_with_valid_json(served):
    sdk, model = served

    def ask(entry: dict) -> tuple[str, str]:
        reply = sdk.chat.completions.create(model=model, messages=messages(entry), temperature=0, max_tokens=400,
                                            response_format=response_format(entry))  # fmt: skip
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    assert len(SCHEMAS) == 20
    with ThreadPoolExecutor(8) as pool:  # the engine batches them
        answers = list(pool.map(ask, SCHEMAS))
    for entry, (text, finish) in zip(SCHEMAS, answers, strict=True):
        assert finish == "stop", (entry["name"], text)
        jsonschema.validate(json.loads(text), entry["schema"])


def test_streamed_answers_reassemble_to_the_whole_ones(served):
    sdk, model = served
    for entry in SCHEMAS[:3]:
        kwargs = dict(model=model, messages=messages(entry), temperature=0, max_tokens=400,
                      response_format=response_format(entry))  # fmt: skip
        whole = sdk.chat.completions.create(**kwargs).choices[0].message.content
        chunks = [c.choices[0].delta.content or "" for c in sdk.chat.completions.create(stream=True, **kwargs)
                  if c.choices]  # fmt: skip
        assert "".join(chunks) == whole and len(chunks) > 5


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_parses_to_the_function_with_valid_arguments(served, choice):
    sdk, model = served
    kwargs = dict(model=model, messages=WEATHER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=100)
    reply = sdk.chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "tool_calls"
    calls = reply.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "add") for c in calls)
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_weather"}
    for call in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed: dict[int, list[str]] = {}
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.id is not None:
                streamed[call.index] = [call.function.name, ""]
            streamed[call.index][1] += call.function.arguments or ""
    assert list(streamed.values()) == [[c.function.name, c.function.arguments] for c in calls]


def test_auto_answers_in_text_or_a_well_formed_call(served):
    sdk, model = served
    for ask in (WEATHER, [{"role": "user", "content": "Say hello to me in one short sentence."}]):
        reply = sdk.chat.completions.create(model=model, messages=ask, tools=TOOLS, temperature=0, max_tokens=80)
        message = reply.choices[0].message
        if message.tool_calls:
            assert reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                assert call.function.name in ("get_weather", "add")
                json.loads(call.function.arguments)
        else:
            assert message.content and "<tool_call>" not in message.content


def test_ngram_speculation_keeps_the_greedy_constrained_output(smollm2_engine):
    entries = SCHEMAS[:6]
    params = [SamplingParams(temperature=0, max_tokens=300, guided_json=json.dumps(e["schema"])) for e in entries]
    prompts = [messages(e) for e in entries]
    # the float32 backend: token-exact with speculation on and off (tests/helpers.py)
    plain = [o.text for o in LLM(smollm2_engine, backend=FLOAT32_BACKEND).generate(prompts, params)]
    llm = LLM(
        smollm2_engine,
        backend=FLOAT32_BACKEND,
        speculative="ngram",
        speculative_adaptive=False,
        speculative_disable_batch_size=8,
    )
    assert [o.text for o in llm.generate(prompts, params)] == plain
    spec = llm.engine.stats().spec_decode
    assert spec is not None and spec.accepted_tokens > 0
    for entry, text in zip(entries, plain, strict=True):
        jsonschema.validate(json.loads(text), entry["schema"])

"""Structured output and tool calling at the doors, without a server: OpenAI bodies (response_format, tools,
tool_choice, guided_* extras) become the contract's fields, checked before any work; they reach the Triton
parser as the same SamplingParams and chat prompt; tools render through the chat template (its own tool
support, or the documented system prompt); a required call's grammar takes exactly the calls it should; and
the model's text parses into OpenAI tool_calls the same whether streamed in any pieces or whole."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from builder.tiny import CHAT_TEMPLATE, make_tokenizer
from engine_format.requests import InvalidRequest
from engine_format.tool_calls import OPEN, call_grammar, call_text, system_prompt
from runtime.engine.chat_tools import ChatPrompt, render
from runtime.gateway.errors import GatewayError, from_validation
from runtime.gateway.protocol import ChatCompletionRequest, CompletionRequest
from runtime.gateway.responses import Choice, CompletionRender, Header, completion
from runtime.gateway.tool_parser import ToolCallParser, parse_whole
from runtime.gateway.wire import Delta
from runtime.triton_model.inputs import parse_request
from tests.test_request_contract import _decoded

HI = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}}  # fmt: skip
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NAMES = frozenset({"get_weather", "add"})


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **fields})


def error_of(**fields) -> GatewayError:
    try:
        body(**fields)
    except ValidationError as exc:
        return from_validation(exc)
    except GatewayError as exc:
        return exc
    pytest.fail(f"accepted: {fields}")


def upstream(request: ChatCompletionRequest):
    [one] = request.upstream_requests()
    return parse_request(_decoded(one))


def test_response_format_becomes_guided_json():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    strict = {"type": "json_schema", "json_schema": {"name": "point", "schema": schema, "strict": True}}
    assert json.loads(upstream(body(response_format=strict)).params.guided_json) == schema
    assert json.loads(upstream(body(response_format={"type": "json_object"})).params.guided_json) == {"type": "object"}
    assert upstream(body(response_format={"type": "text"})).params.grammar is None


def test_guided_extras_reach_the_engine_on_both_endpoints():
    assert upstream(body(guided_choice=["yes", "no"])).params.guided_choice == ("yes", "no")
    assert upstream(body(guided_json={"type": "array"})).params.guided_json == '{"type": "array"}'
    text = CompletionRequest.model_validate({"model": "m", "prompt": "x", "guided_regex": "[0-9]+"})
    [one] = text.upstream_requests()
    assert parse_request(_decoded(one)).params.guided_regex == "[0-9]+"


@pytest.mark.parametrize(
    ("choice", "parallel", "forced"),
    [(None, True, None), ("auto", True, None), ("required", False, {"get_weather", "add"}),
     ({"type": "function", "function": {"name": "add"}}, True, {"add"})],
)  # fmt: skip
def test_tools_reach_the_chat_template_and_required_calls_get_a_grammar(choice, parallel, forced):
    parsed = upstream(body(tools=[WEATHER, ADD], tool_choice=choice, parallel_tool_calls=parallel))
    assert isinstance(parsed.prompt, ChatPrompt) and [t["function"]["name"] for t in parsed.prompt.tools] == [
        "get_weather", "add"]  # fmt: skip
    grammar = parsed.params.guided_grammar
    assert (grammar is None) == (forced is None)
    if grammar is not None:
        assert all((f'"const": "{n}"' in grammar) == (n in forced) for n in NAMES)
        assert ('("\\n" call)*' in grammar) == parallel
    assert body(tools=[WEATHER, ADD], tool_choice=choice).tool_names == NAMES


def test_tool_choice_none_sends_no_tools_and_parses_nothing():
    request = body(tools=[WEATHER], tool_choice="none")
    assert request.tool_names is None and upstream(request).prompt == HI


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "not among 'tools'"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "defined twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]},
         "tools[0].function.parameters", "Invalid type"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot be combined"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "response_format", "not both"),
        ({"guided_regex": "x", "guided_choice": ["y"]}, "guided_choice", "only one"),
        ({"guided_regex": "(x"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": 'root ::= "a" nope'}, "guided_grammar", "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"minimum": "x"}}}},
         "response_format.json_schema.schema", "minimum"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "goes with"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "pattern"),
    ],
)  # fmt: skip
def test_bad_structured_requests_are_400s_naming_the_parameter(fields, param, says):
    error = error_of(**fields)
    assert (error.status, error.param) == (400, param) and says in error.message, error.message


def test_tool_conversations_are_accepted_back():
    turns = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip
    parsed = upstream(ChatCompletionRequest.model_validate({"model": "m", "messages": turns, "tools": [WEATHER]}))
    assert parsed.prompt.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert parsed.prompt.messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    assert error_of(messages=[{"role": "user", "content": None}]).param == "messages.content"
    assert error_of(messages=[{"role": "user", "content": "x", "tool_calls": turns[1]["tool_calls"]}]).status == 400


def test_a_template_without_tool_support_gets_the_documented_format():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    turns = [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "content": "18"}]  # fmt: skip
    text = render(tokenizer, ChatPrompt(turns, [WEATHER]))
    assert text.startswith("<|im_start|>system\n" + system_prompt([WEATHER]))
    assert call_text("get_weather", '{"city": "Paris", "unit": "c"}') in text
    assert "<|im_start|>user\n<tool_response>\n18\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tool_support_renders_them_itself():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = (
        "{% for t in tools %}[TOOL {{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }};{% endfor %}"
        "{{ m.content }}|{% endfor %}"
    )
    turns = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]  # fmt: skip
    text = render(tokenizer, ChatPrompt(turns, [WEATHER, ADD]))
    assert text == "[TOOL get_weather][TOOL add]user:What is the weather in Paris?|assistant:CALL get_weather Oslo;|"


def test_the_engine_refuses_malformed_tool_messages(llama_engine):
    from runtime import LLMEngine, SamplingParams

    engine = LLMEngine(llama_engine)
    with pytest.raises(InvalidRequest, match="tool_calls") as error:
        engine.add_request(ChatPrompt([{"role": "user", "content": "x", "tool_calls": [{}]}]), SamplingParams())
    assert error.value.field == "messages[0].tool_calls"


@pytest.fixture(scope="module")
def llg_tokenizer():
    import llguidance.hf

    tokenizer = make_tokenizer()
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[2])


@pytest.mark.parametrize("parallel", [False, True])
def test_a_required_call_grammar_takes_exactly_valid_calls(llg_tokenizer, parallel):
    from llguidance import LLMatcher, grammar_from

    tokenizer, llg = llg_tokenizer
    grammar = grammar_from("grammar", call_grammar([WEATHER["function"], ADD["function"]], parallel))
    weather, add = call_text("get_weather", '{"city": "Oslo", "unit": "c"}'), call_text("add", '{"a": 1, "b": 2}')

    def takes(text: str) -> bool:
        matcher = LLMatcher(llg, grammar)
        ids = tokenizer.encode(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    assert takes(weather) and takes(add)
    assert takes(weather + "\n" + add) == parallel
    assert not takes(call_text("get_weather", '{"city": "Oslo"}'))  # a required argument missing
    assert not takes(call_text("get_weather", '{"city": "Oslo", "unit": "k"}'))  # outside the enum
    assert not takes(call_text("mul", '{"a": 1, "b": 2}'))  # no such function
    assert not takes("It is sunny.")


STREAMS = [
    "Let me check.\n"
    + call_text("get_weather", '{"city": "New \\"York\\"", "unit": "f"}')
    + "\n"
    + call_text("add", '{"a": 1, "b": 2}'),
    call_text("add", '{"a": -3, "b": 40}'),
    f'{OPEN}\n{{"arguments": {{"a": 1, "b": 2}}, "name": "add"}}\n</tool_call>',  # keys in another order
    f'{OPEN}\n{{"name": "unknown", "arguments": {{}}}}\n</tool_call> and text',
    "No tools needed: it is 18 C in Paris.",
    OPEN + '\n{"name": "add", "arguments": {"a": 1, "b',  # cut by max_tokens
]


@pytest.mark.parametrize("text", STREAMS)
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_calls_reassemble_to_the_whole_answer(text, cuts):
    parser = ToolCallParser(NAMES)
    content, calls, last = "", {}, 0
    for cut in sorted({min(c, len(text)) for c in cuts} | {len(text)}):
        piece, deltas = parser.feed(text[last:cut])
        last, content = cut, content + piece
        for d in deltas:
            if d.name is not None:
                assert d.index == len(calls) and d.id.startswith("call_")  # name first, with the id
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    content += parser.finish()[0]
    whole_content, whole_calls = parse_whole(text, NAMES)
    assert (content or None, list(calls.values())) == (whole_content, [[c.name, c.arguments] for c in whole_calls])


def test_whole_answers_parse_into_openai_tool_calls():
    content, calls = parse_whole(STREAMS[0], NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'New "York"', "unit": "f"}), ("add", {"a": 1, "b": 2})]  # fmt: skip
    assert parse_whole(STREAMS[3], NAMES) == (STREAMS[3], [])
    assert parse_whole(STREAMS[4], NAMES) == (STREAMS[4], [])


def test_responses_carry_tool_calls_whole_and_streamed():
    header = Header("chat", "m", False, NAMES)
    choice = Choice(0, 0, text=STREAMS[0], finish_reason="stop")
    [whole] = completion(header, [choice])["choices"]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "add"]
    form = CompletionRender(header, include_usage=True)
    events, text = [], STREAMS[0]
    for i in range(0, len(text), 7):
        done = i + 7 >= len(text)
        sse = form.chunk(0, Delta(text[i : i + 7], "stop" if done else None, 3, 1), i == 0)
        events += [json.loads(line[6:]) for line in sse.split("\n\n") if line]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and all(e["usage"] is None for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    content, calls = "", {}
    for event in events:
        delta = event["choices"][0]["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["function"]["arguments"] == "" and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    wanted = [[c["function"]["name"], c["function"]["arguments"]] for c in whole["message"]["tool_calls"]]
    assert (content, list(calls.values())) == ("Let me check.", wanted)

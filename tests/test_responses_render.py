"""The Responses API's parts without servers: input items as chat messages, the kept responses' bounds (an
injected clock for expiry), and the event stream, rebuilt by an independent accumulator (OpenAI's event
semantics) at every split of an answer with text and tool calls, equal to the unstreamed Response."""

from __future__ import annotations

import json

import pytest

from runtime.gateway.errors import GatewayError
from runtime.gateway.responses import Choice
from runtime.gateway.responses_api.protocol import ResponsesRequest
from runtime.gateway.responses_api.render import ResponseRender
from runtime.gateway.responses_api.store import ResponseStore
from runtime.gateway.wire import Delta

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
ANSWER = f"Let me add. {CALL}\n{CALL.replace('1', '7')}"


def test_items_become_chat_messages_with_calls_joined():
    request = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Add"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Sure.", "annotations": []}],
                },
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "3"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "4"}]},
            ],
        }
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
    ]
    assert request.turn == [
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": "Sure.", "tool_calls": calls},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        {"role": "tool", "content": "4", "tool_call_id": "c2"},
    ]
    chat = request.chat_request([{"role": "user", "content": "Earlier"}])
    assert [m.role for m in chat.messages] == ["user", "user", "assistant", "tool", "tool"]


def test_chat_errors_name_this_bodys_fields():
    too_long = ResponsesRequest.model_validate({"model": "m", "input": "x", "max_output_tokens": 5})
    with pytest.raises(GatewayError) as err:
        ResponsesRequest.model_validate({"model": "m", "input": "x", "tool_choice": "required"}).chat_request([])
    assert err.value.param == "tool_choice"
    body = {"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "x"}}]}
    with pytest.raises(GatewayError) as err:
        ResponsesRequest.model_validate(body).chat_request([])
    assert err.value.param == "tools[0].parameters" and "'tools[0].parameters'" in err.value.message
    assert too_long.chat_request([]).max_completion_tokens == 5


def test_the_store_keeps_each_owners_newest_within_bounds_and_time():
    now = [0.0]
    store = ResponseStore(max_per_owner=2, max_chars_per_owner=10_000, ttl_s=60, clock=lambda: now[0])
    for i in range(3):
        store.put("alice", {"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    store.put("bob", {"id": "b0"}, [])
    assert store.get("alice", "r2").conversation == [{"role": "user", "content": "2"}]

    def gone(owner: str, response_id: str) -> bool:
        with pytest.raises(GatewayError) as err:
            store.get(owner, response_id, "previous_response_id")
        return (err.value.status, err.value.param) == (404, "previous_response_id")

    assert gone("alice", "r0")  # the oldest went first
    assert gone("bob", "r2")  # another owner's id: as if it never existed
    store.delete("alice", "r2")
    assert gone("alice", "r2") and len(store) == 2
    store.put("alice", {"id": "big1"}, [{"content": "x" * 6000}])
    store.put("alice", {"id": "big2"}, [{"content": "x" * 6000}])  # the size bound drops big1 (the count, r1)
    assert gone("alice", "big1") and gone("alice", "r1") and store.get("alice", "big2")
    store.put("alice", {"id": "huge"}, [{"content": "x" * 20_000}])  # over the whole budget: not kept
    assert gone("alice", "huge") and store.get("alice", "big2")
    now[0] = 61.0
    assert gone("bob", "b0") and gone("alice", "big2") and len(store) == 0


def accumulate(events: list[dict]) -> dict:
    """OpenAI's stream semantics, independently: items added at their output_index, grown by deltas,
    replaced by their done item; the last event's response is returned with the rebuilt output."""
    output: dict[int, dict] = {}
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] not in output
            output[event["output_index"]] = json.loads(json.dumps(event["item"]))
        elif kind == "response.content_part.added":
            output[event["output_index"]]["content"].append(dict(event["part"]))
        elif kind == "response.output_text.delta":
            output[event["output_index"]]["content"][event["content_index"]]["text"] += event["delta"]
        elif kind == "response.function_call_arguments.delta":
            output[event["output_index"]]["arguments"] += event["delta"]
        elif kind == "response.output_item.done":
            assert output[event["output_index"]] | {"status": event["item"]["status"]} == event["item"]
            output[event["output_index"]] = event["item"]
    final = dict(events[-1]["response"])
    final["rebuilt"] = [output[i] for i in sorted(output)]
    return final


def streamed(pieces: list[str], finish: str = "stop") -> list[dict]:
    render = ResponseRender("m", {}, frozenset({"add"}), lambda body: None)
    text = ""
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        text += render.chunk(0, Delta(piece, finish if last else None, 5, i + 1), i == 0)
    text += render.end([Choice(0, 0, "".join(pieces), finish, 5, len(pieces))])
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


def whole(answer: str, finish: str = "stop") -> dict:
    render = ResponseRender("m", {}, frozenset({"add"}), lambda body: None)
    return render.whole([Choice(0, 0, answer, finish, 5, 9)])


@pytest.mark.parametrize("split", range(0, len(ANSWER) + 1, 3))
def test_a_stream_split_anywhere_rebuilds_the_unstreamed_response(split):
    events = streamed([ANSWER[:split], ANSWER[split:]] if 0 < split < len(ANSWER) else [ANSWER])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    final = accumulate(events)
    expected = whole(ANSWER)["output"]
    assert final["rebuilt"] == final["output"]
    assert (
        [(i["type"], i.get("name"), i.get("arguments"), i.get("content")) for i in final["output"]]
        == [
            (
                "message",
                None,
                None,
                [{"type": "output_text", "text": "Let me add.", "annotations": [], "logprobs": []}],
            ),
            ("function_call", "add", '{"a": 1, "b": 2}', None),
            ("function_call", "add", '{"a": 7, "b": 2}', None),
        ]
        == [(i["type"], i.get("name"), i.get("arguments"), i.get("content")) for i in expected]
    )


def test_the_accumulator_catches_a_lost_delta():
    events = streamed([ANSWER[:20], ANSWER[20:40], ANSWER[40:]])
    lost = [e for e in events if e["type"] != "response.function_call_arguments.delta"]
    with pytest.raises(AssertionError):
        final = accumulate(lost)
        assert final["rebuilt"] == final["output"]


def test_a_cut_answer_is_incomplete_and_an_empty_one_a_message():
    events = streamed(["Once upon a"], finish="length")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    empty = whole("")
    assert [(i["type"], i["content"][0]["text"]) for i in empty["output"]] == [("message", "")]
    assert empty["usage"] == {
        "input_tokens": 5,
        "output_tokens": 9,
        "total_tokens": 14,
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def test_an_upstream_failure_mid_stream_ends_with_response_failed():
    render = ResponseRender("m", {}, None, lambda body: pytest.fail("a failed response is not kept"))
    text = render.chunk(0, Delta("Once", None, 5, 1), True)
    text += render.failed(GatewayError(502, "the stream was cut", "upstream_error", code="stream_cut"))
    events = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-3:] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    assert events[-1]["response"]["error"] == {"code": "stream_cut", "message": "the stream was cut"}
    assert events[-1]["response"]["status"] == "failed"
    assert [(i["status"], i["content"][0]["text"]) for i in events[-1]["response"]["output"]] == [
        ("incomplete", "Once")
    ]

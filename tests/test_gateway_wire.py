"""The gateway's hand-built serializations against their plain forms: stream chunks spliced into
pre-serialized text equal json.dumps of the whole chunk object, and Triton messages built and read
without tritonclient's wrappers equal what tritonclient builds and reads. Also the stream's framing
([DONE] with the body's end) and the generation fast path's own 500."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb

from engine_format.requests import FIELD
from runtime.gateway.handler import EventStream
from runtime.gateway.responses import DONE, CompletionRender, Header, _logprobs, sse
from runtime.gateway.wire import Delta, GenerateRequest, TokenLogprob, build_request, parse_response
from runtime.triton_model.inputs import NUMPY_TYPES

TRICKY = [
    "plain", 'say "hi"', "back\\slash \\n \\u0041", "line\nbreak\r\ttab", "naïve café ß", "日本語テキスト",
    "emoji 🦙👩\u200d💻", "controls \x00\x01\x1f\x7f", "\u2028\u2029 separators", "</script><b>", "", " ", "{}[],:",
]  # fmt: skip
LOGPROBS = [TokenLogprob(5, 'tok "q"\n', -0.25, [('tok "q"\n', -0.25), ("token_id:7", -1.5)]),
            TokenLogprob(9, "token_id:9", -3.0, [])]  # fmt: skip


def reference_chunk(header: Header, index: int, delta: Delta, first: bool, include_usage: bool) -> str:
    """The chunk as a dict, serialized whole: what CompletionRender must reproduce byte for byte."""
    logprobs = _logprobs(header, delta.logprobs)
    if header.kind == "chat":
        body = header.base("chat.completion.chunk")
        message = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        body["choices"] = [{"index": index, "delta": message, "logprobs": logprobs,
                            "finish_reason": delta.finish_reason}]  # fmt: skip
    else:
        body = header.base("text_completion")
        body["choices"] = [{"index": index, "text": delta.text, "logprobs": logprobs,
                            "finish_reason": delta.finish_reason}]  # fmt: skip
    if include_usage:
        body["usage"] = None
    return sse(body)


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("want_logprobs", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_spliced_chunk_is_the_whole_objects_json(kind, want_logprobs, include_usage):
    for model in ("llm", 'odd "model" \\ ü'):
        header = Header(kind, model, want_logprobs)
        form = CompletionRender(header, include_usage)
        for index in (0, 3, 15):  # n > 1: each choice's own index
            for text in TRICKY:
                for finish in (None, "stop", "length"):
                    for first in (True, False):
                        delta = Delta(text, finish, 7, 2, LOGPROBS if want_logprobs else [])
                        got = form.chunk(index, delta, first)
                        assert got == reference_chunk(header, index, delta, first, include_usage)
                        parsed = json.loads(got.removeprefix("data: "))
                        assert got.endswith("\n\n") and parsed["choices"][0]["index"] == index
                        assert (parsed["choices"][0]["delta"]["content"] if kind == "chat"
                                else parsed["choices"][0]["text"]) == text  # fmt: skip


def test_the_role_is_announced_on_a_choices_first_chat_chunk_only():
    form = CompletionRender(Header("chat", "llm", False), False)
    first, later = (json.loads(form.chunk(0, Delta("x", None, 1, 1), f)[6:]) for f in (True, False))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert later["choices"][0]["delta"] == {"content": "x"} and "usage" not in later


def raw_response(outputs: dict[str, tuple[str, object]], typed: bool = False) -> pb.ModelInferResponse:
    """A ModelInferResponse as Triton sends it (raw contents), or with typed contents."""
    response = pb.ModelInferResponse(model_name="llm")
    for name, (datatype, value) in outputs.items():
        tensor = response.outputs.add(name=name, datatype=datatype, shape=[1])
        if datatype == "BYTES":
            if typed:
                tensor.contents.bytes_contents.append(value)
            else:
                response.raw_output_contents.append(len(value).to_bytes(4, "little") + value)
        elif typed:
            tensor.contents.int_contents.append(value)
        else:
            response.raw_output_contents.append(np.array([value], dtype=np.int32).tobytes())
    return response


@pytest.mark.parametrize("typed", [False, True])
def test_responses_parse_as_tritonclient_reads_them(typed):
    logprobs = b'[{"token_id": 5, "token": "a\\"b", "logprob": -0.5, "top": [[5, -0.5, "a\\"b"], [7, -1.5]]}]'
    for text in TRICKY:
        outputs = {"text_output": ("BYTES", text.encode()), "finish_reason": ("BYTES", b""),
                   "prompt_tokens": ("INT32", 500), "completion_tokens": ("INT32", 2**31 - 1),
                   "logprobs": ("BYTES", logprobs)}  # fmt: skip
        response = raw_response(outputs, typed)
        delta = parse_response(response)
        result = grpcclient.InferResult(response)
        assert delta.text == result.as_numpy("text_output")[0].decode() == text
        assert (delta.finish_reason, delta.prompt_tokens, delta.completion_tokens) == (None, 500, 2**31 - 1)
        assert [(lp.token_id, lp.token, lp.top) for lp in delta.logprobs] == [
            (5, 'a"b', [('a"b', -0.5), ("token_id:7", -1.5)])
        ]
    last = raw_response({"finish_reason": ("BYTES", b"length"), "text_output": ("BYTES", b""),
                         "completion_tokens": ("INT32", 3), "prompt_tokens": ("INT32", 1)}, typed)  # fmt: skip
    assert parse_response(last) == Delta("", "length", 1, 3, [])  # any output order; logprobs not asked: none
    with pytest.raises(KeyError, match="prompt_tokens"):
        parse_response(raw_response({"text_output": ("BYTES", b"x"), "finish_reason": ("BYTES", b"")}, typed))


def test_requests_carry_what_tritonclient_would_send():
    params = {"max_tokens": 3, "temperature": 0.7, "ignore_eos": True, "seed": 2**40, "logprobs": 2}
    request = GenerateRequest(None, [{"role": "user", "content": 'é "q"'}], params, ("a", "bé"), "id-1", "salt")
    message = build_request("llm", request, stream=True)
    assert (message.model_name, message.id) == ("llm", "id-1")
    assert [o.name for o in message.outputs] == [
        "text_output",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "logprobs",
    ]
    numbers = {name: np.array([value], NUMPY_TYPES[FIELD[name].triton_type]) for name, value in params.items()}
    texts = {
        "messages": [json.dumps(request.messages).encode()],
        "stop": [b"a", "bé".encode()],
        "cache_salt": [b"salt"],
    }
    expected = {**numbers, "stream": np.array([True]), **{k: np.array(v, np.object_) for k, v in texts.items()}}
    assert [t.name for t in message.inputs] == list(expected)
    for tensor, raw in zip(message.inputs, message.raw_input_contents, strict=True):
        reference = grpcclient.InferInput(tensor.name, list(tensor.shape), tensor.datatype)
        reference.set_data_from_numpy(expected[tensor.name])
        assert raw == reference._get_content(), tensor.name  # the bytes tritonclient would put on the wire
    plain = build_request("llm", GenerateRequest("hi", None, {}), stream=False)
    assert [t.name for t in plain.inputs] == ["stream", "text_input"] and len(plain.outputs) == 4


def asgi_sends(app, scope: dict) -> list[dict]:
    """The messages an ASGI app sends for one request with an empty body."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_the_done_event_goes_out_with_the_end_of_the_body_after_the_stream_cleaned_up():
    cleaned = []

    async def events():
        try:
            yield "data: 1\n\n"
            yield DONE
        finally:
            cleaned.append(True)  # the handler's accounting and exchange.close() run after [DONE] is yielded

    sent = asgi_sends(EventStream(events(), media_type="text/event-stream"), {"type": "http"})
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"data: 1\n\n", True), (DONE.encode(), False)]
    assert cleaned == [True]
    sent = asgi_sends(EventStream(iter_async(["data: x\n\n"]), media_type="text/event-stream"), {"type": "http"})
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"data: x\n\n", True), (b"", False)]  # no [DONE]


async def iter_async(items: list[str]):
    for item in items:
        yield item


def test_a_crash_in_a_generation_request_is_an_openai_shaped_500(monkeypatch):
    from runtime.gateway import app as app_module
    from runtime.gateway.routing import GatewayConfig
    from runtime.gateway.service import Gateway, GatewaySettings

    async def crash(*args: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(app_module, "generate", crash)
    app = app_module.create_app(Gateway(GatewayConfig.single("m", "127.0.0.1:1"), GatewaySettings()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    start, body = asgi_sends(app, scope)
    assert start["status"] == 500
    assert json.loads(body["body"])["error"]["type"] == "server_error"

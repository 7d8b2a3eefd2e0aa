"""The Triton door's token-id prompts (`input_ids`) and its tokenizer answers (`tokenize`): parsed and refused by
the request contract, and answered by the engine's own tokenizer (runtime/triton_model/tokenize.py, through
AsyncLLM, as the `llm` model calls it)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from engine_format.requests import InvalidRequest
from runtime import AsyncLLM, EngineArgs
from runtime.triton_model.inputs import door_error, parse_request
from runtime.triton_model.tokenize import tokenizer_answer


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def test_a_token_id_prompt_is_parsed():
    parsed = parse_request({"input_ids": ids(5, 6, 7), "max_tokens": ids(2)})
    assert parsed.prompt == [5, 6, 7] and parsed.params.max_tokens == 2 and parsed.tokenize is None


@pytest.mark.parametrize(
    ("inputs", "field", "says"),
    [
        ({"input_ids": ids(1), "text_input": text("hi")}, "input_ids", "give one prompt"),
        ({"input_ids": ids(1, -2)}, "input_ids", "must be in [0, 2147483647]"),
        ({"input_ids": np.array([1.5])}, "input_ids", "must hold integers"),
        ({"input_ids": ids()}, "input_ids", "non-empty list"),
        ({"text_input": text("hi"), "tokenize": text("encrypt")}, "tokenize", 'must be "encode" or "decode"'),
        ({"text_input": text("hi"), "tokenize": text("decode")}, "tokenize", "token ids in 'input_ids'"),
    ],
)
def test_bad_token_inputs_name_the_field(inputs, field, says):
    with pytest.raises(InvalidRequest) as caught:
        parse_request(inputs)
    assert caught.value.field == field and says in str(caught.value)


def test_engine_errors_about_an_id_prompt_name_input_ids():
    parsed = parse_request({"input_ids": ids(1)})
    engine_error = InvalidRequest("prompt", "token id 99 outside the vocabulary [0, 64)")
    assert door_error(engine_error, parsed).field == "input_ids"
    assert door_error(engine_error).field == "text_input"


@pytest.fixture(scope="module")
def engine(llama_engine):
    engine = AsyncLLM(llama_engine, EngineArgs(backend="cpu"))
    yield engine
    engine.shutdown()


def answer(engine: AsyncLLM, inputs: dict[str, np.ndarray]):
    return asyncio.run(tokenizer_answer(engine, parse_request(inputs), "r"))


def test_encode_and_decode_are_the_engines(engine):
    tokenizer = engine.admission.tokenizer
    encoded = answer(engine, {"text_input": text("Paged attention"), "tokenize": text("encode")})
    body = json.loads(encoded.text)
    assert body == {"tokens": tokenizer.encode("Paged attention"), "max_model_len": engine.context_tokens}
    assert encoded.num_prompt_tokens == len(body["tokens"]) and encoded.finished
    chat = [{"role": "user", "content": "Hi there"}]
    messages = answer(engine, {"messages": text(json.dumps(chat)), "tokenize": text("encode")})
    assert json.loads(messages.text)["tokens"] == engine.admission.tokenize(chat)  # the chat template's, as served
    decoded = answer(engine, {"input_ids": ids(*body["tokens"]), "tokenize": text("decode")})
    assert decoded.text == tokenizer.decode(body["tokens"], skip_special_tokens=False)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        answer(engine, {"input_ids": ids(engine.admission.vocab_size), "tokenize": text("decode")})

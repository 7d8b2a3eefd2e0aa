"""One upstream generation on the wire: its request, its deltas, and Triton's KServe gRPC messages for them.

The messages are tritonclient's protobuf classes, built and read here directly, not through tritonclient's
InferInput / InferResult: the gateway reads one response per streamed token, and InferResult.as_numpy (a numpy
array and a BYTES-tensor deserialization for each of five outputs) cost more CPU than the rest of a token's
path together; on the cores tritonserver shares, that CPU is the engine's. Raw tensor bytes are Triton's: a
BYTES element is a 4-byte little-endian length and the bytes, numbers are little-endian in their dtype.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from engine_format.requests import FIELD, OUTPUT_NAMES

LOGPROBS = "logprobs"  # read (so asked for: Triton sends only the outputs asked) when the request wants them
PROMPT_LOGPROBS = "prompt_logprobs"  # the same, for the prompt's scores
KV_HANDLE = "kv_handle"  # read from prefill-only requests (disaggregation)
TOKEN_IDS = "token_ids"  # read from resumable streams: what resume_token_ids takes after a replica failed
OPTIONAL = (LOGPROBS, PROMPT_LOGPROBS, KV_HANDLE, TOKEN_IDS)
OUTPUTS = tuple(name for name in OUTPUT_NAMES if name not in OPTIONAL)  # always read
NUMPY_TYPES = {"INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}


@dataclass(frozen=True)
class GenerateRequest:
    """One upstream generation: exactly one of `prompt` (raw text, or token ids) or `messages` (chat)."""

    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    params: Mapping[str, int | float | bool]  # scalar fields of the request contract (engine_format/requests.py)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    cache_salt: str | None = None  # the tenant's (service.Gateway.cache_salt)
    lora: str | None = None  # the LoRA adapter the client named as its model (runtime/gateway/loras.py)
    texts: Mapping[str, str | list[str]] = field(default_factory=dict)  # string fields: guided_*, logit_bias (JSON)
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template (with messages)
    prefill_only: bool = False  # disaggregation: to a prefill worker, answered with the first token and a handle
    kv_handle: str | None = None  # disaggregation: to a decode worker, which reads that KV
    tokenize: str | None = None  # "encode" / "decode": the model's tokenizer answers, nothing is generated
    resumable: bool = False  # a stream whose token ids come back, so a replica's failure can be resumed from
    resume_token_ids: tuple[int, ...] = ()  # the answer so far, when resumed (runtime/gateway/exchange.py)

    def resumed(self, answer: Sequence[int]) -> GenerateRequest:
        """This stream again after its replica failed, going on after `answer` (its prompt's scores went out)."""
        params = {name: value for name, value in self.params.items() if name != PROMPT_LOGPROBS}
        return replace(self, params=params, resume_token_ids=tuple(answer))


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the model's "token" text when it sends one, else "token_id:<id>"
    logprob: float
    top: list[tuple[str, float]]  # the alternatives' (token, logprob), most likely first
    top_ids: tuple[int, ...] = ()  # their ids, in the same order


@dataclass(frozen=True)
class Delta:
    """Text since the previous delta; finish_reason is set on the last one only."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    kv_handle: str | None = None  # a prefill worker's answer to a prefill-only request (finish reason handoff)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when asked: the first is None
    token_ids: tuple[int, ...] = ()  # when asked (a resumable stream): the delta's tokens


def token_name(token_id: int, text: str | None = None) -> str:
    return text if text is not None else f"token_id:{token_id}"


def parse_logprobs(raw: bytes) -> list[TokenLogprob]:
    """The model's logprobs JSON: an entry per generated token."""
    return [_token_logprob(entry) for entry in json.loads(raw or b"[]")]


def parse_prompt_logprobs(raw: bytes) -> list[TokenLogprob | None]:
    """The model's prompt_logprobs JSON: an entry per prompt token, null for the first (nothing before it)."""
    return [None if entry is None else _token_logprob(entry) for entry in json.loads(raw)]


def _token_logprob(entry: dict[str, Any]) -> TokenLogprob:
    # top entries: [token_id, logprob, text] (models before token text sent [token_id, logprob])
    alternatives = entry.get("top", [])
    top = [(token_name(int(t[0]), t[2] if len(t) > 2 else None), float(t[1])) for t in alternatives]
    token_id = entry["token_id"]
    return TokenLogprob(
        token_id,
        token_name(token_id, entry.get("token")),
        float(entry["logprob"]),
        top,
        tuple(int(t[0]) for t in alternatives),
    )


def _encode(name: str, values: list[Any]) -> bytes:
    datatype = FIELD[name].triton_type
    if datatype == "BYTES":
        return b"".join(len(v).to_bytes(4, "little") + v for v in values)
    return np.array(values, dtype=NUMPY_TYPES[datatype]).tobytes()  # numpy's cast, as tritonclient's: huge -> inf


def build_request(model: str, request: GenerateRequest, stream: bool) -> Any:
    """The ModelInferRequest of one generation, its inputs typed by the request contract
    (engine_format/requests.py), asking for the outputs `parse_response` reads."""
    values: dict[str, list[Any]] = {**{name: [value] for name, value in request.params.items()}, "stream": [stream]}
    if request.messages is not None:
        values["messages"] = [json.dumps(request.messages).encode()]
    elif isinstance(request.prompt, list):
        values["input_ids"] = request.prompt
    else:
        values["text_input"] = [(request.prompt or "").encode()]
    if request.tokenize is not None:
        values["tokenize"] = [request.tokenize.encode()]
    if request.stop:
        values["stop"] = [s.encode() for s in request.stop]
    if request.cache_salt is not None:
        values["cache_salt"] = [request.cache_salt.encode()]
    if request.lora is not None:
        values["lora"] = [request.lora.encode()]
    for name, text in request.texts.items():
        values[name] = [t.encode() for t in text] if isinstance(text, list) else [text.encode()]
    if request.tools is not None:
        values["tools"] = [json.dumps(request.tools).encode()]
    if request.prefill_only:
        values["prefill_only"] = [True]
    if request.kv_handle is not None:
        values[KV_HANDLE] = [request.kv_handle.encode()]
    if request.resume_token_ids:
        values["resume_token_ids"] = list(request.resume_token_ids)
    message = pb.ModelInferRequest(model_name=model, id=request.request_id)
    for name, value in values.items():
        message.inputs.add(name=name, datatype=FIELD[name].triton_type, shape=[len(value)])
        message.raw_input_contents.append(_encode(name, value))
    wanted = (
        *OUTPUTS,
        *((LOGPROBS,) if LOGPROBS in request.params else ()),
        *((PROMPT_LOGPROBS,) if PROMPT_LOGPROBS in request.params else ()),
        *((KV_HANDLE,) if request.prefill_only else ()),
        *((TOKEN_IDS,) if request.resumable else ()),
    )
    for name in wanted:
        message.outputs.add(name=name)
    return message


def _element(raw: bytes) -> bytes:
    """The first element of a raw BYTES tensor."""
    return raw[4 : 4 + int.from_bytes(raw[:4], "little")]


def parse_response(response: Any) -> Delta:
    """The llm model's ModelInferResponse -> its Delta; KeyError names a missing output. (Once per streamed
    token: plain lookups, no comprehension per field.)"""
    if response.raw_output_contents:  # Triton's way
        raw = dict(zip([o.name for o in response.outputs], response.raw_output_contents, strict=True))
        text, finish = _element(raw["text_output"]), _element(raw["finish_reason"])
        prompt = int.from_bytes(raw["prompt_tokens"][:4], "little", signed=True)
        completion = int.from_bytes(raw["completion_tokens"][:4], "little", signed=True)
        logprobs = _element(raw[LOGPROBS]) if LOGPROBS in raw else b""
        handle = _element(raw[KV_HANDLE]) if KV_HANDLE in raw else b""
        scored = _element(raw[PROMPT_LOGPROBS]) if PROMPT_LOGPROBS in raw else b""
        ids = tuple(np.frombuffer(raw[TOKEN_IDS], dtype="<i4").tolist()) if TOKEN_IDS in raw else ()
    else:  # typed contents: KServe's other encoding
        typed = {o.name: o.contents for o in response.outputs}
        text, finish = typed["text_output"].bytes_contents[0], typed["finish_reason"].bytes_contents[0]
        prompt = int(typed["prompt_tokens"].int_contents[0])
        completion = int(typed["completion_tokens"].int_contents[0])
        logprobs = typed[LOGPROBS].bytes_contents[0] if LOGPROBS in typed else b""
        handle = typed[KV_HANDLE].bytes_contents[0] if KV_HANDLE in typed else b""
        scored = typed[PROMPT_LOGPROBS].bytes_contents[0] if PROMPT_LOGPROBS in typed else b""
        ids = tuple(typed[TOKEN_IDS].int_contents) if TOKEN_IDS in typed else ()
    return Delta(
        text.decode("utf-8", errors="replace"),
        finish.decode() or None,
        prompt,
        completion,
        parse_logprobs(logprobs) if logprobs not in (b"", b"[]") else [],
        handle.decode() if handle else None,
        parse_prompt_logprobs(scored) if scored not in (b"", b"[]") else None,
        ids,
    )

"""Triton request tensors -> a validated request, by the request contract (engine_format/requests.py).

The model's inputs are the contract's fields (model_repository/llm/config.pbtxt declares exactly these,
with these types: a test checks it). Integers are INT64 on the wire, so Triton's JSON parser never
truncates them (it silently wraps values beyond the declared width); SamplingParams checks each value's
range with the contract's words. Work per request is bounded before it costs anything (Limits): sizes
are checked before a string is decoded or a JSON document parsed, and the prompt before it is tokenized.
Pure Python over numpy arrays: tested without a server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_format.requests import (
    FIELD,
    FIELDS,
    SAMPLING_FIELDS,
    InvalidRequest,
    Kind,
    Limits,
    RequestField,
    json_depth_exceeds,
)
from engine_format.tool_calls import check_tools
from runtime import SamplingParams
from runtime.engine.admission import Prompt
from runtime.engine.chat_tools import ChatPrompt

# The Triton door's defaults where they differ from the engine's: greedy, and up to the end of the context.
TRITON_DEFAULTS = {f.name: f.default_for("triton") for f in SAMPLING_FIELDS if f.default_for("triton") != f.default}
TRITON_RESERVED = "triton_"  # request parameters Triton's own clients set (triton_enable_empty_final_response)
NUMPY_TYPES = {"INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_, "BYTES": np.object_}
FIELD_NAMES = {"prompt": "text_input"}  # engine errors name the prompt "prompt"; this door calls it text_input


def config_type(field: RequestField) -> str:
    """The field's type as config.pbtxt writes it."""
    return "TYPE_STRING" if field.triton_type == "BYTES" else f"TYPE_{field.triton_type}"


@dataclass(frozen=True)
class LoraAdmin:
    action: str  # "load", "unload" or "list"
    name: str | None = None
    path: str | None = None


LORA_ACTIONS = ("load", "unload", "list")


def _lora_admin(inputs: Mapping[str, np.ndarray], limits: Limits) -> LoraAdmin:
    """A lora_admin request: its action, the adapter's name (`lora`) and directory (`lora_path`, for "load")."""
    action, name, path = (
        _value(inputs[n], FIELD[n], limits) if n in inputs else None for n in ("lora_admin", "lora", "lora_path")
    )
    if action not in LORA_ACTIONS:
        raise InvalidRequest("lora_admin", f"must be one of {', '.join(LORA_ACTIONS)} (got {action!r})")
    if action != "list" and name is None:
        raise InvalidRequest("lora", f'lora_admin "{action}" names the adapter in `lora`')
    if (action == "load") != (path is not None):
        raise InvalidRequest("lora_path", 'is given with lora_admin "load" only (the adapter directory)')
    extra = sorted(set(inputs) - {"lora_admin", "lora", "lora_path", "text_input", "stream"})
    if extra:
        raise InvalidRequest(extra[0], "a lora_admin request takes only `lora` and `lora_path`")
    return LoraAdmin(action, name, path)


@dataclass(frozen=True)
class ParsedRequest:
    prompt: Prompt
    params: SamplingParams
    stream: bool
    prefill_only: bool = False  # disaggregation: end after the first token, answering with a KV handle
    kv_handle: str | None = None  # disaggregation: read this prefill worker's KV, continue after its first token
    tokenize: str | None = None  # "encode" / "decode": the tokenizer answers (runtime/triton_model/tokenize.py)
    resume_token_ids: tuple[int, ...] = ()  # the answer so far of a stream cut on a failed replica
    lora_admin: LoraAdmin | None = None  # load / unload / list adapters (runtime/triton_model/lora_admin.py)


def parse_request(
    inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None = None, limits: Limits | None = None
) -> ParsedRequest:
    """`inputs`: input name -> numpy array as Triton delivers it (strings as bytes objects).
    `parameters`: the request's parameters (Triton's generate endpoint turns every JSON field that
    is no input into one, so a misspelled field lands here): any is refused by name, but Triton's own."""
    limits = limits or Limits()
    unknown = sorted(p for p in parameters or {} if not p.startswith(TRITON_RESERVED))
    if unknown:
        raise InvalidRequest(unknown[0], f"unknown field; allowed: {', '.join(f.name for f in FIELDS)}")
    for name in inputs:
        if name not in FIELD:
            raise InvalidRequest(name, "unknown input")
    if "lora_admin" in inputs:  # administration: no prompt (the gateway's text_input is empty)
        return ParsedRequest("", SamplingParams(), False, lora_admin=_lora_admin(inputs, limits))
    if "lora_path" in inputs:
        raise InvalidRequest("lora_path", 'is given with lora_admin "load" only (the adapter directory)')
    text = _text(inputs, "text_input", limits.max_prompt_bytes)
    messages = _text(inputs, "messages", limits.max_messages_bytes)
    ids = _value(inputs["input_ids"], FIELD["input_ids"], limits) if "input_ids" in inputs else None
    prompt: Prompt
    if ids is not None:
        if text is not None or messages is not None:
            raise InvalidRequest("input_ids", "give one prompt: 'text_input', 'messages' or 'input_ids'")
        prompt = ids
    elif text is not None and messages is None:
        if not text:
            raise InvalidRequest("text_input", "must not be empty")
        if len(text) > limits.max_prompt_chars:
            raise InvalidRequest("text_input", f"is {len(text)} characters; the limit is {limits.max_prompt_chars}")
        prompt = text
    elif messages is not None and text is None:
        chat = _messages(messages, limits)
        tools = _text(inputs, "tools", 4 * _max_chars(FIELD["tools"]))
        prompt = chat if tools is None else ChatPrompt(chat, _tools(tools, limits))
    else:
        raise InvalidRequest(
            "text_input", "give exactly one of 'text_input' (a string), 'messages' (JSON) or 'input_ids' (token ids)"
        )
    if "tools" in inputs and messages is None:
        raise InvalidRequest("tools", "needs 'messages' (the chat template renders the tools)")
    values: dict[str, Any] = dict(TRITON_DEFAULTS)
    for field in SAMPLING_FIELDS:
        if field.name in inputs:
            values[field.name] = _value(inputs[field.name], field, limits)
    stream = bool(_scalar(inputs["stream"], FIELD["stream"])) if "stream" in inputs else False
    prefill_only = bool(_scalar(inputs["prefill_only"], FIELD["prefill_only"])) if "prefill_only" in inputs else False
    kv_handle = _value(inputs["kv_handle"], FIELD["kv_handle"], limits) if "kv_handle" in inputs else None
    if prefill_only and kv_handle is not None:
        raise InvalidRequest(
            "kv_handle", "give prefill_only (to a prefill worker) or kv_handle (to a decode worker), not both"
        )
    tokenize = _value(inputs["tokenize"], FIELD["tokenize"], limits) if "tokenize" in inputs else None
    if tokenize not in (None, "encode", "decode"):
        raise InvalidRequest("tokenize", f'must be "encode" or "decode" (got {tokenize!r})')
    if tokenize == "decode" and ids is None:
        raise InvalidRequest("tokenize", "\"decode\" takes the token ids in 'input_ids'")
    resume = (
        _value(inputs["resume_token_ids"], FIELD["resume_token_ids"], limits) if "resume_token_ids" in inputs else ()
    )
    if resume and (prefill_only or kv_handle is not None):
        raise InvalidRequest("resume_token_ids", "a resumed stream is not disaggregated (no prefill_only or kv_handle)")
    return ParsedRequest(prompt, SamplingParams(**values), stream, prefill_only, kv_handle, tokenize, tuple(resume))


def door_error(error: InvalidRequest, parsed: ParsedRequest | None = None) -> InvalidRequest:
    """An engine error named in this door's words (its prompt is `text_input`, or `input_ids` where it was ids)."""
    ids = parsed is not None and isinstance(parsed.prompt, list) and all(isinstance(t, int) for t in parsed.prompt)
    name = "input_ids" if ids and error.field == "prompt" else FIELD_NAMES.get(error.field)
    return error if name is None else InvalidRequest(name, str(error).partition(": ")[2])


def _value(array: np.ndarray, field: RequestField, limits: Limits) -> Any:
    if field.kind is Kind.TEXTS:
        return _texts(array, field, limits)
    if field.kind is Kind.TEXT:
        return _text({field.name: array}, field.name, 4 * _max_chars(field))
    if field.kind is Kind.TOKEN_MAP:
        return _token_map(array, field)
    if field.kind is Kind.INTS:
        return _ints(array, field)
    return _scalar(array, field)


def _ints(array: np.ndarray, field: RequestField) -> list[int]:
    """A list input of integers, its size bounded before it is converted; its values checked by the contract."""
    values = np.asarray(array).reshape(-1)
    if field.max_items is not None and values.size > field.max_items:
        raise InvalidRequest(field.name, f"has {values.size} numbers; the limit is {field.max_items}")
    if not np.issubdtype(values.dtype, np.integer):
        raise InvalidRequest(field.name, f"must hold integers (got {values.dtype})")
    out = values.tolist()
    field.check(out)
    return out


TOKEN_MAP_ENTRY_BYTES = 64  # '"123456": -12.345678,' with room for JSON's longer number forms


def _token_map(array: np.ndarray, field: RequestField) -> dict[str, Any]:
    """A JSON object of token ids to numbers (logit_bias), its size bounded before it is parsed; its entries are
    checked by SamplingParams (the contract's words)."""
    text = _text({field.name: array}, field.name, TOKEN_MAP_ENTRY_BYTES * int(field.max_items or 1))
    assert text is not None
    try:
        value = json.loads(text) if not json_depth_exceeds(text, 1) else None
    except (json.JSONDecodeError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise InvalidRequest(field.name, 'must be a JSON object of token ids to numbers, e.g. {"50256": -100}')
    return value


def _max_chars(field: RequestField) -> int:
    return int(field.range.hi if field.range and field.range.hi else 1)


def _text(inputs: Mapping[str, np.ndarray], name: str, max_bytes: int) -> str | None:
    if name not in inputs:
        return None
    values = np.asarray(inputs[name]).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(name, f"must be a single string (got {values.size} values)")
    if isinstance(values[0], bytes | str) and len(values[0]) > max_bytes:
        raise InvalidRequest(name, f"is {len(values[0])} bytes; the limit is {max_bytes}")
    return _decode(values[0], name)


def _decode(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(name, "is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise InvalidRequest(name, f"must be a string (got {type(value).__name__})")


def _messages(raw: str, limits: Limits) -> list[dict[str, Any]]:
    if json_depth_exceeds(raw, limits.max_json_depth):
        raise InvalidRequest("messages", f"is nested more than {limits.max_json_depth} levels deep")
    try:
        messages = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise InvalidRequest("messages", f"is not valid JSON ({reason})") from None
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", 'must be a JSON list of {"role": ..., "content": ...} objects')
    if len(messages) > limits.max_messages:
        raise InvalidRequest("messages", f"has {len(messages)} messages; the limit is {limits.max_messages}")
    chars = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        calls_only = content is None and isinstance(message, dict) and message.get("tool_calls")
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not (isinstance(content, str) or calls_only)
        ):
            raise InvalidRequest(f"messages[{i}]", 'must be an object with string "role" and "content" (or '
                                                   '"tool_calls")')  # fmt: skip
        chars += len(content or "")
    if chars > limits.max_prompt_chars:
        raise InvalidRequest("messages", f"hold {chars} characters of content; the limit is {limits.max_prompt_chars}")
    return messages


def _tools(text: str, limits: Limits) -> list[dict[str, Any]]:
    if json_depth_exceeds(text, 2 * limits.max_json_depth):  # a tool's parameters are a JSON schema
        raise InvalidRequest("tools", f"is nested more than {2 * limits.max_json_depth} levels deep")
    try:
        tools = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise InvalidRequest("tools", "is not valid JSON") from None
    return check_tools(tools)


def _texts(array: np.ndarray, field: RequestField, limits: Limits) -> tuple[str, ...]:
    """Strings of a list input, their count and sizes bounded before any is decoded: `stop`'s by `limits`,
    the others' by their contract field."""
    stop = field.name == "stop"
    most = limits.max_stop_strings if stop else int(field.max_items or 1)
    longest = limits.max_stop_chars if stop else _max_chars(field)
    values = np.asarray(array).reshape(-1)
    if values.size > most:
        raise InvalidRequest(field.name, f"has {values.size} strings; the limit is {most}")
    if any(isinstance(v, bytes | str) and len(v) > 4 * longest for v in values):
        raise InvalidRequest(field.name, f"strings may have at most {longest} characters")
    texts = tuple(_decode(v, field.name) for v in values)
    if any(len(t) > longest for t in texts):
        raise InvalidRequest(field.name, f"strings may have at most {longest} characters")
    return texts


def _scalar(array: np.ndarray, field: RequestField) -> Any:
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(field.name, f"must be a single value (got {values.size})")
    value = values[0]
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise InvalidRequest(field.name, f"has the wrong type ({type(value).__name__})")

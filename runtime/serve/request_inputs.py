"""Triton request tensors -> (prompt, SamplingParams, stream): every field validated.

Pure Python over numpy arrays, so it is tested without a server. Names and types match
model_repository/llm/config.pbtxt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.engine.admission import Prompt
from runtime.engine.errors import InvalidRequest
from runtime.engine.sampling_params import SamplingParams

# Triton input name -> SamplingParams field, for scalar inputs.
SCALAR_PARAMS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "priority": "priority",
    "logprobs": "logprobs",
    "ignore_eos": "ignore_eos",
    "ttft_target_s": "ttft_target_s",
    "itl_target_s": "itl_target_s",
}
DEFAULTS = {"temperature": 0.0, "max_tokens": 128}  # greedy unless the client says otherwise


@dataclass(frozen=True)
class ParsedRequest:
    prompt: Prompt
    params: SamplingParams
    stream: bool


def parse_request(inputs: Mapping[str, np.ndarray]) -> ParsedRequest:
    """`inputs`: input name -> numpy array as Triton delivers it (strings as bytes objects)."""
    text = _text(inputs, "text_input")
    messages = _text(inputs, "messages")
    prompt: Prompt
    if text is not None and messages is None:
        prompt = text
    elif messages is not None and text is None:
        prompt = _messages(messages)
    else:
        raise InvalidRequest("text_input", "give exactly one of 'text_input' (a string) or 'messages' (JSON)")
    values: dict[str, Any] = dict(DEFAULTS)
    for name, field in SCALAR_PARAMS.items():
        if name in inputs:
            values[field] = _scalar(inputs[name], name)
    if "stop" in inputs:
        values["stop"] = tuple(_decode(s, "stop") for s in np.asarray(inputs["stop"]).reshape(-1))
    stream = bool(_scalar(inputs["stream"], "stream")) if "stream" in inputs else False
    return ParsedRequest(prompt, SamplingParams(**values), stream)


def _text(inputs: Mapping[str, np.ndarray], name: str) -> str | None:
    if name not in inputs:
        return None
    values = np.asarray(inputs[name]).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(name, f"must be a single string (got {values.size} values)")
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


def _messages(raw: str) -> list[dict[str, Any]]:
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest("messages", f"is not valid JSON ({exc.msg})") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages) or not messages:
        raise InvalidRequest("messages", 'must be a JSON list of {"role": ..., "content": ...} objects')
    return messages


def _scalar(array: np.ndarray, name: str) -> Any:
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(name, f"must be a single value (got {values.size})")
    value = values[0]
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise InvalidRequest(name, f"has the wrong type ({type(value).__name__})")

"""The Triton model's inputs, in one table, and Triton request tensors -> a validated request.

INPUTS is the one home of the model's request contract: model_repository/llm/config.pbtxt
declares exactly these inputs with these types (a test checks it), the model parses with it
and the gateway builds its tensors from it. Integers are INT64 on the wire, so Triton's JSON
parser never truncates them (it silently wraps values beyond the declared width), and each
carries an explicit range checked here. Pure Python over numpy arrays: tested without a server.

Work per request is bounded before it costs anything (Limits): sizes are checked before a
string is decoded or a JSON document parsed, and the prompt before it is tokenized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from runtime.engine.admission import Prompt
from runtime.engine.errors import InvalidRequest
from runtime.engine.sampling_params import MAX_LOGPROBS, SamplingParams

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str  # Triton's tensor datatype (config.pbtxt: TYPE_<datatype>, BYTES there is TYPE_STRING)
    dtype: type  # numpy
    field: str | None  # the SamplingParams field it sets; None: not a sampling parameter
    lo: int | None = None  # integers: the allowed range (floats are checked by SamplingParams)
    hi: int | None = None
    many: bool = False  # dims [-1] (a list), else one value

    @property
    def config_type(self) -> str:
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"


INPUTS: tuple[InputSpec, ...] = (
    InputSpec("text_input", "BYTES", np.object_, None),
    InputSpec("messages", "BYTES", np.object_, None),  # JSON chat messages
    InputSpec("stream", "BOOL", np.bool_, None),
    InputSpec("max_tokens", "INT64", np.int64, "max_tokens", 1, INT32_MAX),
    InputSpec("temperature", "FP32", np.float32, "temperature"),
    InputSpec("top_k", "INT64", np.int64, "top_k", 0, INT32_MAX),
    InputSpec("top_p", "FP32", np.float32, "top_p"),
    InputSpec("min_p", "FP32", np.float32, "min_p"),
    InputSpec("repetition_penalty", "FP32", np.float32, "repetition_penalty"),
    InputSpec("presence_penalty", "FP32", np.float32, "presence_penalty"),
    InputSpec("frequency_penalty", "FP32", np.float32, "frequency_penalty"),
    InputSpec("seed", "INT64", np.int64, "seed", 0, INT64_MAX),
    InputSpec("stop", "BYTES", np.object_, "stop", many=True),
    InputSpec("priority", "INT64", np.int64, "priority", -(2**31), INT32_MAX),
    InputSpec("logprobs", "INT64", np.int64, "logprobs", 0, MAX_LOGPROBS),
    InputSpec("ignore_eos", "BOOL", np.bool_, "ignore_eos"),
    InputSpec("ttft_target_s", "FP32", np.float32, "ttft_target_s"),
    InputSpec("itl_target_s", "FP32", np.float32, "itl_target_s"),
    InputSpec("cache_salt", "BYTES", np.object_, "cache_salt"),  # prefix-cache isolation (one per tenant)
    InputSpec("stream_interval", "INT64", np.int64, "stream_interval", 1, INT32_MAX),  # tokens per streamed response
)
INPUT = {spec.name: spec for spec in INPUTS}
# Inputs holding one number or flag -> their SamplingParams field.
SCALAR_PARAMS = {s.name: s.field for s in INPUTS if s.field is not None and s.datatype != "BYTES"}
DEFAULTS = {"temperature": 0.0}  # greedy unless the client says otherwise
TRITON_RESERVED = "triton_"  # request parameters Triton's own clients set (triton_enable_empty_final_response)
OPENAI_MAX_STRING = 10_485_760  # OpenAI's longest accepted string (prompt or message content), in characters


@dataclass(frozen=True)
class Limits:
    """Bounds on one request's work (model config parameters of the same names override them)."""

    max_prompt_chars: int = OPENAI_MAX_STRING  # prompt or all messages' content together
    max_messages: int = 2048  # OpenAI's bound on `messages`
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string (the stream holds back this much text)
    max_json_depth: int = 32  # `messages` JSON nesting (a chat message needs 3)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # a zero bound would refuse every request
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer (got {value!r})")

    @property
    def max_prompt_bytes(self) -> int:
        return 4 * self.max_prompt_chars  # UTF-8: at most 4 bytes a character

    @property
    def max_messages_bytes(self) -> int:
        # Each content character is at most 6 bytes of JSON ("\\uXXXX"), plus each message's keys and role.
        return 6 * self.max_prompt_chars + 256 * self.max_messages


@dataclass(frozen=True)
class ParsedRequest:
    prompt: Prompt
    params: SamplingParams
    stream: bool
    max_tokens_given: bool  # else resolve_max_tokens() sets it once the prompt's tokens are known


def parse_request(
    inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None = None, limits: Limits | None = None
) -> ParsedRequest:
    """`inputs`: input name -> numpy array as Triton delivers it (strings as bytes objects).
    `parameters`: the request's parameters (Triton's generate endpoint turns every JSON field that
    is no input into one, so a misspelled field lands here): any is refused by name, but Triton's own."""
    limits = limits or Limits()
    unknown = sorted(p for p in parameters or {} if not p.startswith(TRITON_RESERVED))
    if unknown:
        raise InvalidRequest(unknown[0], f"unknown field; allowed: {', '.join(s.name for s in INPUTS)}")
    for name in inputs:
        if name not in INPUT:
            raise InvalidRequest(name, "unknown input")
    text = _text(inputs, "text_input", limits.max_prompt_bytes)
    messages = _text(inputs, "messages", limits.max_messages_bytes)
    prompt: Prompt
    if text is not None and messages is None:
        if not text:
            raise InvalidRequest("text_input", "must not be empty")
        if len(text) > limits.max_prompt_chars:
            raise InvalidRequest("text_input", f"is {len(text)} characters; the limit is {limits.max_prompt_chars}")
        prompt = text
    elif messages is not None and text is None:
        prompt = _messages(messages, limits)
    else:
        raise InvalidRequest("text_input", "give exactly one of 'text_input' (a string) or 'messages' (JSON)")
    values: dict[str, Any] = dict(DEFAULTS)
    for name, field in SCALAR_PARAMS.items():
        if name in inputs:
            values[field] = _scalar(inputs[name], INPUT[name])
    if "stop" in inputs:
        values["stop"] = _stop(inputs["stop"], limits)
    salt = _text(inputs, "cache_salt", 4 * 256)
    if salt is not None:
        values["cache_salt"] = salt
    stream = bool(_scalar(inputs["stream"], INPUT["stream"])) if "stream" in inputs else False
    return ParsedRequest(prompt, SamplingParams(**values), stream, "max_tokens" in values)


def resolve_max_tokens(parsed: ParsedRequest, prompt_tokens: int, context_tokens: int) -> SamplingParams:
    """Without max_tokens, generate up to the remaining context (as OpenAI and vLLM do); a prompt
    that leaves no room is refused, naming the prompt."""
    room = context_tokens - prompt_tokens
    if room < 1:
        field = "messages" if isinstance(parsed.prompt, list) else "text_input"
        raise InvalidRequest(field, f"the prompt ({prompt_tokens} tokens) exceeds the engine's max sequence length "
                                    f"({context_tokens} tokens, the first output token included)")  # fmt: skip
    return parsed.params if parsed.max_tokens_given else replace(parsed.params, max_tokens=room)


def prompt_char_limit(tokenizer: Any, context_tokens: int, cap: int = OPENAI_MAX_STRING) -> int:
    """The most characters a prompt that fits `context_tokens` can have: no token decodes to more
    characters than its vocabulary string has (byte-level BPE: one per byte; SentencePiece: '▁' is
    one space), so a longer prompt is refused before it is tokenized, never wrongly."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return min(cap, context_tokens * max(1, longest))


def json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether JSON `text` nests deeper than `limit`, found without parsing it (json.loads recurses
    once a level: a deep document would end in RecursionError). Strings are dropped first."""
    depth = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False


_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


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
        if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise InvalidRequest(f"messages[{i}]", 'must be an object with string "role" and "content"')
        chars += len(message["content"])
    if chars > limits.max_prompt_chars:
        raise InvalidRequest("messages", f"hold {chars} characters of content; the limit is {limits.max_prompt_chars}")
    return messages


def _stop(array: np.ndarray, limits: Limits) -> tuple[str, ...]:
    values = np.asarray(array).reshape(-1)
    if values.size > limits.max_stop_strings:
        raise InvalidRequest("stop", f"has {values.size} strings; the limit is {limits.max_stop_strings}")
    stops = tuple(_decode(s, "stop") for s in values)
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise InvalidRequest("stop", f"strings may have at most {limits.max_stop_chars} characters")
    return stops


def _scalar(array: np.ndarray, spec: InputSpec) -> Any:
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(spec.name, f"must be a single value (got {values.size})")
    value = values[0]
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        number = int(value)
        if spec.lo is not None and spec.hi is not None and not spec.lo <= number <= spec.hi:
            raise InvalidRequest(spec.name, f"must be in [{spec.lo}, {spec.hi}] (got {number})")
        return number
    if isinstance(value, np.floating):
        return float(value)
    raise InvalidRequest(spec.name, f"has the wrong type ({type(value).__name__})")

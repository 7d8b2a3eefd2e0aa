"""The request contract: every field a client may set on a generation, declared once.

Each field has its name, kind, allowed range, default per entry point and meaning. Everything else
is derived from this table, so a field is added or changed here and nowhere else:
- the engine's SamplingParams validates its values with `check` (executors/sampling/params.py);
- the Triton model's inputs (model_repository/llm/config.pbtxt, checked by a test) and their parsing
  (runtime.triton_model.inputs) use `triton_type` and the ranges;
- the OpenAI gateway's request bodies (runtime.gateway.protocol) take their bounds and defaults from it.

Defaults differ by door, as their users expect: the Python API samples at temperature 1.0 and stops
after 128 tokens (SamplingParams' defaults); the Triton model is greedy and, without `max_tokens`,
generates up to the end of the context; the OpenAI door follows OpenAI (temperature 1.0, up to the
context for chat, 16 tokens for completions). "Up to the context" is `max_tokens` None, resolved by the
engine's admission once the prompt's tokens are known.

Stdlib only: the gateway process imports it without the engine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_CHOICES = 16  # OpenAI's `n` (and prompts x n): choice j samples with seed + j
OPENAI_MAX_STRING = 10_485_760  # OpenAI's longest accepted string (prompt or message content), in characters
CHAT_ROLES = ("system", "user", "assistant", "tool")  # what the engine's chat templates are given
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_GRAMMAR_CHARS = 131_072  # a JSON schema, regex, grammar or tool list (engine_format/grammars.py)
MAX_GUIDED_CHOICES, MAX_CHOICE_CHARS = 256, 1024
MAX_PROMPT_TOKENS = 1_048_576  # a prompt sent as token ids (input_ids): far past any engine's context
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (OpenAI's docs show a few; vLLM sets no bound)
MAX_KV_HANDLE_CHARS = 16 * 2**20  # a handle lists its prompt's tokens: ~10 characters a token, plus metadata


class InvalidRequest(ValueError):
    """A request parameter or prompt is invalid; `field` names the offending field, the message what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Kind(Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    TEXT = "text"  # one string
    TEXTS = "texts"  # a list of strings
    TOKEN_MAP = "token_map"  # token id -> number (JSON text on the Triton wire, as OpenAI's object)
    INTS = "ints"  # a list of integers


TRITON_TYPES = {Kind.INT: "INT64", Kind.INTS: "INT64", Kind.FLOAT: "FP32", Kind.BOOL: "BOOL"} | dict.fromkeys(
    (Kind.TEXT, Kind.TEXTS, Kind.TOKEN_MAP), "BYTES"
)


@dataclass(frozen=True)
class Range:
    """Numbers from `lo` to `hi` (None: unbounded), each end closed unless said open."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else _number(self.lo)
        hi = "inf" if self.hi is None else _number(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"{left}{lo}, {hi}{right}"


class _Same:
    """A door's default that is the engine's."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()


@dataclass(frozen=True)
class RequestField:
    name: str
    kind: Kind
    doc: str
    range: Range | None = None  # numbers (INTS: each); TEXT/TEXTS: the length of each string; TOKEN_MAP: each value
    default: Any = None  # the engine's (SamplingParams, the Python API); None: not set
    triton_default: Any = SAME  # the Triton model's, where it differs
    openai_default: Any = SAME  # the OpenAI gateway's, where it differs
    max_items: int | None = None  # TEXTS: how many strings; TOKEN_MAP: how many entries; INTS: how many numbers
    sampling: bool = True  # a SamplingParams field (else the request's: prompt, stream)

    @property
    def triton_type(self) -> str:
        """The Triton tensor datatype (config.pbtxt: TYPE_<type>, BYTES there is TYPE_STRING)."""
        return TRITON_TYPES[self.kind]

    @property
    def optional(self) -> bool:
        """None is a value here: not set (a door's default of None; `max_tokens` None: up to the context)."""
        return any(self.default_for(door) is None for door in ("engine", "triton", "openai"))

    def default_for(self, door: str) -> Any:
        """The default at `door`: "engine", "triton" or "openai"."""
        value = {"engine": self.default, "triton": self.triton_default, "openai": self.openai_default}[door]
        return self.default if value is SAME else value

    def check(self, value: Any) -> None:
        """InvalidRequest naming this field unless `value` is allowed."""
        problem = self.problem(value)
        if problem is not None:
            raise InvalidRequest(self.name, problem)

    def problem(self, value: Any) -> str | None:
        """Why `value` is not allowed here (None: it is), in words naming what is."""
        if self.kind is Kind.BOOL:
            return None if isinstance(value, bool) else f"must be true or false (got {value!r})"
        if self.kind is Kind.INT:
            if not isinstance(value, int) or isinstance(value, bool):
                return f"must be an integer (got {value!r})"
        elif self.kind is Kind.FLOAT:
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                return f"must be a finite number (got {value!r})"
        elif self.kind is Kind.TEXT:
            return self._text_problem(value)
        elif self.kind is Kind.TOKEN_MAP:
            return self._token_map_problem(value)
        elif self.kind is Kind.INTS:
            return self._ints_problem(value)
        else:
            return self._texts_problem(value)
        return None if self.range is None or self.range.contains(value) else f"must be in {self.range} (got {value})"

    def _text_problem(self, value: Any, what: str = "a string") -> str | None:
        if not isinstance(value, str):
            return f"must be {what} (got {type(value).__name__})"
        if self.range is not None and not self.range.contains(len(value)):
            return f"must be {what} of {_length(self.range)} characters (got {len(value)})"
        return None

    def _ints_problem(self, value: Any) -> str | None:
        if not isinstance(value, tuple | list) or not value:
            return f"must be a non-empty list of integers (got {type(value).__name__})"
        if self.max_items is not None and len(value) > self.max_items:
            return f"has {len(value)} numbers; the limit is {self.max_items}"
        for number in value:
            if not isinstance(number, int) or isinstance(number, bool):
                return f"must hold integers only (got {number!r})"
            if self.range is not None and not self.range.contains(number):
                return f"numbers must be in {self.range} (got {number})"
        return None

    def _token_map_problem(self, value: Any) -> str | None:
        if not isinstance(value, Mapping):
            return f"must be an object of token ids to numbers (got {type(value).__name__})"
        if self.max_items is not None and len(value) > self.max_items:
            return f"has {len(value)} entries; the limit is {self.max_items}"
        for key, number in value.items():
            if token_id(key) is None:
                return f"keys must be token ids, integers >= 0 (got {key!r})"
            if not isinstance(number, int | float) or isinstance(number, bool) or not math.isfinite(number):
                return f"values must be finite numbers (got {number!r} for token {key})"
            if self.range is not None and not self.range.contains(number):
                return f"values must be in {self.range} (got {number} for token {key})"
        return None

    def _texts_problem(self, value: Any) -> str | None:
        if not isinstance(value, tuple | list):
            return f"must be a list of strings (got {type(value).__name__})"
        if self.max_items is not None and len(value) > self.max_items:
            return f"has {len(value)} strings; the limit is {self.max_items}"
        problems = (self._text_problem(v, "strings") for v in value)
        return next((p for p in problems if p is not None), None)


# fmt: off
FIELDS: tuple[RequestField, ...] = (
    RequestField("text_input", Kind.TEXT, "The prompt as text (or give `messages`).", sampling=False),
    RequestField("messages", Kind.TEXT, "The prompt as JSON chat messages, rendered by the model's chat template.",
                 sampling=False),
    RequestField("input_ids", Kind.INTS, "The prompt as token ids (or give text_input or messages).",
                 Range(0, INT32_MAX), max_items=MAX_PROMPT_TOKENS, sampling=False),
    RequestField("tokenize", Kind.TEXT, 'Answer from the tokenizer, generating nothing: "encode" (the prompt\'s '
                 'token ids: text_output is {"tokens": [...], "max_model_len": N}, prompt_tokens their count) or '
                 '"decode" (text_output is input_ids\' text).', Range(6, 6), sampling=False),
    RequestField("stream", Kind.BOOL, "Stream the answer as it is generated.", default=False, sampling=False),
    RequestField("max_tokens", Kind.INT, "Most tokens to generate; unset: up to the end of the context.",
                 Range(1, INT32_MAX), default=128, triton_default=None, openai_default=None),
    RequestField("temperature", Kind.FLOAT, "Sampling temperature; 0 is greedy.", Range(0.0, 2.0), default=1.0,
                 triton_default=0.0),
    RequestField("top_k", Kind.INT, "Sample from the k most likely tokens; 0: all.", Range(0, INT32_MAX), default=0),
    RequestField("top_p", Kind.FLOAT, "Sample from the smallest set of tokens with this much probability.",
                 Range(0.0, 1.0, lo_open=True), default=1.0),
    RequestField("min_p", Kind.FLOAT, "Drop tokens less likely than this times the most likely one.",
                 Range(0.0, 1.0), default=0.0),
    RequestField("repetition_penalty", Kind.FLOAT, "Above 1 discourages tokens already in the prompt or output.",
                 Range(0.0, None, lo_open=True), default=1.0),
    RequestField("presence_penalty", Kind.FLOAT, "Subtracted once from a token that appeared in the output.",
                 Range(-2.0, 2.0), default=0.0),
    RequestField("frequency_penalty", Kind.FLOAT, "Subtracted per occurrence of a token in the output.",
                 Range(-2.0, 2.0), default=0.0),
    RequestField("seed", Kind.INT, "Makes sampling reproducible (choice j of n samples with seed + j).",
                 Range(0, INT64_MAX - MAX_CHOICES)),
    RequestField("stop", Kind.TEXTS, "Strings that end the answer (not included in it).", Range(1, MAX_STOP_CHARS),
                 default=(), max_items=MAX_STOP_STRINGS),
    RequestField("priority", Kind.INT, "Lower runs first; first come, first served within a priority.",
                 Range(-(2**31), INT32_MAX), default=0),
    RequestField("logprobs", Kind.INT, "Log-probabilities of each token and this many alternatives.", Range(0, 20)),
    RequestField("prompt_logprobs", Kind.INT, "Log-probabilities of each prompt token given those before it, and "
                 "this many alternatives (the first token's is null); such a prompt is computed whole, never read "
                 "from the prefix cache.", Range(0, 20)),
    RequestField("logit_bias", Kind.TOKEN_MAP, "Added to the logits of these token ids before sampling (-100 bans "
                 "a token, 100 all but forces it); their logprobs include it.", Range(-100.0, 100.0),
                 max_items=MAX_LOGIT_BIAS),
    RequestField("ignore_eos", Kind.BOOL, "Keep generating past the end-of-sequence token.", default=False),
    RequestField("ttft_target_s", Kind.FLOAT, "Time-to-first-token target: orders prefills, refuses at once if the "
                 "queue cannot meet it.", Range(0.0, None, lo_open=True)),
    RequestField("itl_target_s", Kind.FLOAT, "Inter-token latency target: steps carry only the prefill that keeps "
                 "decodes within it.", Range(0.0, None, lo_open=True)),
    RequestField("cache_salt", Kind.TEXT, "Only requests with the same salt share prefix-cache blocks.",
                 Range(1, 256)),
    RequestField("lora", Kind.TEXT, "The LoRA adapter that runs the request (a name the server serves); unset: the "
                 "base model. Its prefix-cache blocks are its own.", Range(1, 128)),
    RequestField("lora_admin", Kind.TEXT, 'LoRA adapters, generating nothing: "load" (the adapter in lora_path, '
                 'under the name in `lora`), "unload" (the adapter in `lora`) or "list"; text_output is the adapters '
                 'served after it (JSON). Set by the gateway\'s admin routes.', Range(4, 6), sampling=False),
    RequestField("lora_path", Kind.TEXT, 'The adapter directory (PEFT format) of lora_admin "load".',
                 Range(1, 4096), sampling=False),
    RequestField("stream_interval", Kind.INT, "Tokens per streamed response (at least the server's).",
                 Range(1, INT32_MAX)),
    # Structured output: at most one of the four (engine_format/grammars.py says what each means and checks them).
    RequestField("guided_json", Kind.TEXT, "Constrain the output to this JSON schema (JSON text; '{\"type\": "
                 "\"object\"}' is any JSON object).", Range(1, MAX_GRAMMAR_CHARS)),
    RequestField("guided_regex", Kind.TEXT, "Constrain the output to match this regular expression (Rust regex "
                 "syntax, anchored at both ends).", Range(1, MAX_GRAMMAR_CHARS)),
    RequestField("guided_grammar", Kind.TEXT, "Constrain the output to this context-free grammar (GBNF with a "
                 "`root` rule, or Lark with a `start` rule).", Range(1, MAX_GRAMMAR_CHARS)),
    RequestField("guided_choice", Kind.TEXTS, "Constrain the output to exactly one of these strings.",
                 Range(1, MAX_CHOICE_CHARS), max_items=MAX_GUIDED_CHOICES),
    RequestField("tools", Kind.TEXT, "Functions the model may call (with `messages`): a JSON list of OpenAI tool "
                 "definitions, rendered by the chat template (engine_format/tool_calls.py).",
                 Range(1, MAX_GRAMMAR_CHARS), sampling=False),
    # Prefill/decode disaggregation (docs/disaggregation.md): set by the gateway, between workers; never an
    # OpenAI body field.
    RequestField("prefill_only", Kind.BOOL, "A prefill worker runs the prompt and the first token only, keeps the "
                 "KV pinned and answers with `kv_handle` (finish reason handoff).", default=False, sampling=False),
    RequestField("kv_handle", Kind.TEXT, "A prefill worker's KV handle (JSON, engine_format/kv_handle.py): a decode "
                 "worker reads that KV and continues after its first token.", Range(1, MAX_KV_HANDLE_CHARS),
                 sampling=False),
    # Set by the gateway too: a stream resumed on another (or the restarted) replica after its replica failed.
    RequestField("resume_token_ids", Kind.INTS, "The answer so far of a stream cut by a failed replica: generation "
                 "goes on after these tokens, which count as output (completion_tokens, max_tokens, penalties, a "
                 "seed's draws) but are not sent again.", Range(0, INT32_MAX), max_items=MAX_PROMPT_TOKENS,
                 sampling=False),
)
# fmt: on
FIELD = {f.name: f for f in FIELDS}
SAMPLING_FIELDS = tuple(f for f in FIELDS if f.sampling)


@dataclass(frozen=True)
class OutputField:
    name: str
    triton_type: str
    doc: str


# What the Triton model answers (a response carries those its client asked for; all by default).
OUTPUTS: tuple[OutputField, ...] = (
    OutputField("text_output", "BYTES", "The answer's text (the delta when streaming)."),
    OutputField("finish_reason", "BYTES", "Why it ended (stop, length, abort, deadline, error); empty until then."),
    OutputField("prompt_tokens", "INT32", "Tokens in the prompt."),
    OutputField("completion_tokens", "INT32", "Tokens generated so far."),
    OutputField("logprobs", "BYTES", "JSON: each token's text, log-probability and alternatives."),
    OutputField(
        "prompt_logprobs",
        "BYTES",
        "JSON: the same for each prompt token (the first is null), on the request's first response.",
    ),
    OutputField("kv_handle", "BYTES", "Finish reason handoff (a prefill_only request): the KV handle's JSON."),
    OutputField(
        "token_ids", "INT32", "The answer's token ids (the delta's when streaming): what resume_token_ids takes."
    ),
)
OUTPUT_NAMES = tuple(o.name for o in OUTPUTS)


@dataclass(frozen=True)
class Limits:
    """Bounds on one request's work, checked before it costs anything (the Triton model's config parameters of
    the same names override them; the gateway checks the defaults)."""

    max_prompt_chars: int = OPENAI_MAX_STRING  # prompt or all messages' content together
    max_messages: int = 2048  # OpenAI's bound on `messages`
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS  # per stop string (the stream holds back this much text)
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
        # Each content character is at most 6 bytes of JSON (a \\u escape and 4 hex digits), plus each
        # message's keys and role.
        return 6 * self.max_prompt_chars + 256 * self.max_messages


def token_id(key: Any) -> int | None:
    """A token id given as an integer or as decimal text (JSON object keys are strings), or None if not one."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    return None


def json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether JSON `text` nests deeper than `limit`, found without parsing it (json.loads recurses once a
    level: a deep document would end in RecursionError). Strings are dropped first."""
    depth = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False


_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**63 else f"{value:g}"


def _length(bounds: Range) -> str:
    lo = int(bounds.lo or 0)
    return f"{lo} to {int(bounds.hi)}" if bounds.hi is not None else f"at least {lo}"

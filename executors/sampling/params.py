"""Per-request generation parameters, validated at admission against the request contract
(engine_format/requests.py: each field's range, and the words of the error, are declared there).

Below the engine (executors/sampling/) because the samplers read them on either side of the backend
line: the engine's numpy sampler and a GPU backend's device sampler. `from runtime import
SamplingParams` is the public name."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_format.grammars import GUIDED_FIELDS, GrammarSpec, guided_spec
from engine_format.requests import FIELD, SAMPLING_FIELDS, InvalidRequest, token_id

MAX_LOGPROBS = 20
assert FIELD["logprobs"].range is not None and FIELD["logprobs"].range.hi == MAX_LOGPROBS
_DEFAULTS = {field.name: field.default for field in SAMPLING_FIELDS}  # the Python API's: the contract's "engine"


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and when to stop. temperature=0 means greedy.

    The fields a client may set are the request contract's (engine_format/requests.py: their meaning,
    ranges and these defaults); the rest are the Python API's own. Penalties follow the OpenAI/vLLM
    definitions: repetition_penalty divides positive logits of tokens already in prompt or output and
    multiplies negative ones, presence_penalty is subtracted once for a token that appeared in the output,
    frequency_penalty per occurrence."""

    max_tokens: int | None = _DEFAULTS["max_tokens"]  # None: up to the end of the context (admission)
    temperature: float = _DEFAULTS["temperature"]
    top_k: int = _DEFAULTS["top_k"]
    top_p: float = _DEFAULTS["top_p"]
    min_p: float = _DEFAULTS["min_p"]
    repetition_penalty: float = _DEFAULTS["repetition_penalty"]
    presence_penalty: float = _DEFAULTS["presence_penalty"]
    frequency_penalty: float = _DEFAULTS["frequency_penalty"]
    seed: int | None = _DEFAULTS["seed"]
    stop: tuple[str, ...] = _DEFAULTS["stop"]
    ignore_eos: bool = _DEFAULTS["ignore_eos"]
    logit_bias: Mapping[int, float] | None = _DEFAULTS["logit_bias"]  # token id -> bias (ids as text accepted)
    logprobs: int | None = _DEFAULTS["logprobs"]
    prompt_logprobs: int | None = _DEFAULTS["prompt_logprobs"]
    priority: int = _DEFAULTS["priority"]
    ttft_target_s: float | None = _DEFAULTS["ttft_target_s"]
    itl_target_s: float | None = _DEFAULTS["itl_target_s"]
    cache_salt: str | None = _DEFAULTS["cache_salt"]
    lora: str | None = _DEFAULTS["lora"]  # the adapter's name (the engine's LoRA manager resolves it)
    stream_interval: int | None = _DEFAULTS["stream_interval"]  # None: the server's (the larger applies)
    # Structured output, at most one (engine_format/grammars.py; enforced by executors/sampling/grammar.py).
    guided_json: str | None = _DEFAULTS["guided_json"]
    guided_regex: str | None = _DEFAULTS["guided_regex"]
    guided_grammar: str | None = _DEFAULTS["guided_grammar"]
    guided_choice: tuple[str, ...] | None = _DEFAULTS["guided_choice"]
    # The Python API's own.
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    deadline_s: float | None = None  # give up (finish_reason "deadline") this long after arrival

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.guided_choice, list):
            object.__setattr__(self, "guided_choice", tuple(self.guided_choice))
        self.validate()
        if self.logit_bias is not None:  # keys as ints (JSON gives text), values as floats: checked above
            bias = {token_id(k): float(v) for k, v in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", bias or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output is constrained to (None: free), from whichever guided field is set."""
        return guided_spec({name: getattr(self, name) for name in GUIDED_FIELDS})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from user JSON-ish input; unknown fields are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequest(unknown[0], f"unknown parameter; allowed: {', '.join(sorted(known))}")
        return cls(**data)

    def validate(self) -> None:
        for field in SAMPLING_FIELDS:
            value = getattr(self, field.name)
            if value is not None or not field.optional:
                field.check(value)
        # The Python API's own knobs (no door takes them).
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "must be non-negative integers")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, "must be true or false")
        if self.deadline_s is not None and not (_finite(self.deadline_s) and self.deadline_s > 0):
            raise InvalidRequest("deadline_s", f"must be a number of seconds > 0 (got {self.deadline_s!r})")
        if self.grammar is not None and self.ignore_eos:  # a complete grammar allows nothing but the end
            raise InvalidRequest("ignore_eos", "cannot be combined with guided decoding (a finished grammar allows "
                                               "only the end of the sequence)")  # fmt: skip
        if self.ttft_target_s is not None and self.deadline_s is not None and self.ttft_target_s > self.deadline_s:
            raise InvalidRequest(
                "ttft_target_s", f"must not exceed deadline_s ({self.ttft_target_s} > {self.deadline_s})"
            )


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

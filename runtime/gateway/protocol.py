"""OpenAI request bodies (pydantic, strict): what the gateway accepts, validated before Triton sees it.

Strict types: "5" is not an integer and true is not a number, as in OpenAI's API. Unknown
fields are errors (errors.from_validation names them; OpenAI parameters this server lacks
are called unsupported). A field sent as null counts as not sent. Each generation field's range and
this door's default come from the request contract (engine_format/requests.py), which the engine's
SamplingParams and the Triton model's inputs check too, and sizes from its Limits, so a request that
passes here is not refused upstream for its parameters.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, PrivateAttr, model_validator

from engine_format.requests import CHAT_ROLES, FIELD, INT32_MAX, MAX_CHOICES, MAX_PROMPT_TOKENS, Limits
from runtime.gateway.errors import GatewayError
from runtime.gateway.strict import Strict as _Strict
from runtime.gateway.structured import GuidedExtras, ResponseFormat, Tool, ToolChoice, chat_guided, upstream_tools
from runtime.gateway.wire import GenerateRequest

LIMITS = Limits()  # the model's default bounds (its max_prompt_chars may be lower: it knows the tokenizer)
MAX_N = MAX_CHOICES
MAX_STOP = LIMITS.max_stop_strings
MAX_BODY_BYTES = 64 * 2**20  # a prompt of max_prompt_chars, JSON-escaped, fits
MAX_JSON_DEPTH = LIMITS.max_json_depth


def bounds(name: str) -> Any:
    """pydantic's constraints of the contract field `name`: its range (numbers) or lengths (strings)."""
    field, limits = FIELD[name], FIELD[name].range
    if limits is None:
        return Field()
    if field.kind.value in ("text", "texts"):  # each string's length
        return Field(min_length=int(limits.lo or 0), max_length=None if limits.hi is None else int(limits.hi))
    edges: dict[str, Any] = {}
    if limits.lo is not None:
        edges["gt" if limits.lo_open else "ge"] = limits.lo
    if limits.hi is not None:
        edges["lt" if limits.hi_open else "le"] = limits.hi
    return Field(allow_inf_nan=False, **edges) if field.kind.value == "float" else Field(**edges)


def default(name: str) -> Any:
    """This door's default of the contract field `name` (OpenAI's where it differs)."""
    return FIELD[name].default_for("openai")


MaxTokens = Annotated[int, bounds("max_tokens")]
PromptText = Annotated[str, Field(max_length=LIMITS.max_prompt_chars)]
TokenIds = Annotated[list[Annotated[int, bounds("input_ids")]], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
Seconds = Annotated[float, bounds("ttft_target_s")]
StopText = Annotated[str, bounds("stop")]


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
assert set(get_args(ChatRole)) - {"developer"} == set(CHAT_ROLES), "the contract's roles, and OpenAI's 'developer'"


class CallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(_Strict):
    role: ChatRole
    content: PromptText | Annotated[list[TextPart], Field(max_length=LIMITS.max_messages)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call answered

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise GatewayError.invalid("only assistant messages carry 'tool_calls'", "messages.tool_calls")
        if self.content is None and self.tool_calls is None:
            raise GatewayError.invalid("a message needs 'content' (or, from the assistant, 'tool_calls')",
                                       "messages.content")  # fmt: skip
        return self

    def as_upstream(self) -> dict[str, Any]:
        """Text content for the model's chat template; 'developer' is OpenAI's new name for 'system'."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class Generation(GuidedExtras):
    """Fields both endpoints share, OpenAI's and trtserve's extras (sent as extra body fields; the guided_*
    ones in GuidedExtras)."""

    model: str
    max_tokens: MaxTokens | None = default("max_tokens")
    temperature: Annotated[float, bounds("temperature")] = default("temperature")
    top_p: Annotated[float, bounds("top_p")] = default("top_p")
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, bounds("seed")] | None = default("seed")
    presence_penalty: Annotated[float, bounds("presence_penalty")] = default("presence_penalty")
    frequency_penalty: Annotated[float, bounds("frequency_penalty")] = default("frequency_penalty")
    user: str | None = None
    # trtserve extras
    top_k: Annotated[int, bounds("top_k")] = default("top_k")
    min_p: Annotated[float, bounds("min_p")] = default("min_p")
    repetition_penalty: Annotated[float, bounds("repetition_penalty")] = default("repetition_penalty")
    ignore_eos: bool = default("ignore_eos")
    priority: Annotated[int, bounds("priority")] = default("priority")
    ttft_target_s: Seconds | None = default("ttft_target_s")  # latency targets (the contract says how they act)
    itl_target_s: Annotated[float, bounds("itl_target_s")] | None = default("itl_target_s")
    # Prefix-cache isolation within the tenant: mixed with the tenant's own salt (service.Gateway.cache_salt).
    cache_salt: Annotated[str, bounds("cache_salt")] | None = default("cache_salt")
    prompt_logprobs: Annotated[int, bounds("prompt_logprobs")] | None = default("prompt_logprobs")  # vLLM's extra
    logit_bias: dict[str, float] | None = default("logit_bias")  # token id (as text) -> bias
    # A stream cut by its replica's failure goes on elsewhere, or there once it is back (runtime/gateway/exchange.py)
    resume_on_failure: bool = True

    @model_validator(mode="after")
    def _shared_checks(self) -> Generation:
        if self.stream_options is not None and not self.stream:
            raise GatewayError.invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if self.logit_bias is not None:
            problem = FIELD["logit_bias"].problem(self.logit_bias)
            if problem is not None:
                raise GatewayError.invalid(f"'logit_bias' {problem}", "logit_bias")
        if self.prompt_logprobs is not None and self.stream:
            raise GatewayError.invalid("'prompt_logprobs' is not supported with 'stream'", "prompt_logprobs")
        if self.prompt_chars > LIMITS.max_prompt_chars:
            field = "messages" if isinstance(self, ChatCompletionRequest) else "prompt"
            raise GatewayError.invalid(f"the prompt has {self.prompt_chars} characters; the limit is "
                                       f"{LIMITS.max_prompt_chars}", field, "prompt_too_long")  # fmt: skip
        return self

    @property
    def tool_names(self) -> frozenset[str] | None:
        """The functions whose calls the answer is parsed for (None: it is text)."""
        return None

    def structured(self) -> tuple[dict[str, str | list[str]], list[dict[str, Any]] | None]:
        """The contract's guided_* fields and the tools this body sends upstream (checked: a 400 otherwise)."""
        return self.guided(), None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_n(self) -> int | None:
        """Top alternatives per token to ask the engine for; None: no logprobs."""
        return None

    @property
    def prompt_logprobs_n(self) -> int | None:
        """Top alternatives per prompt token to ask the engine for; None: the prompt is not scored."""
        return self.prompt_logprobs

    @property
    def echoed(self) -> tuple[str | list[int], ...] | None:
        """The prompts the answer repeats before each choice's text (completions' `echo`), or None."""
        return None

    @property
    def scores_only(self) -> bool:
        """The answer leaves the generated tokens out (echo with max_tokens 0)."""
        return False

    @property
    def prompt_chars(self) -> int:
        return sum(len(p or "") + sum(len(m["content"]) for m in ms or []) for p, ms in self._inputs())

    @abstractmethod  # pydantic's model metaclass is an ABCMeta: a Generation itself cannot be built
    def _inputs(self) -> list[tuple[str | list[int] | None, list[dict[str, Any]] | None]]:
        """(prompt, messages) per prompt."""

    def upstream_requests(self, cache_salt: str | None = None) -> list[GenerateRequest]:
        """One upstream generation per choice, n per prompt; choice j of a prompt samples with seed + j
        (reproducible, and distinct from its siblings). `cache_salt`: the tenant's (not the body's)."""
        params: dict[str, int | float | bool] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos, "priority": self.priority,
        }  # fmt: skip
        if self.token_limit is not None:
            params["max_tokens"] = self.token_limit
        if self.logprobs_n is not None:
            params["logprobs"] = self.logprobs_n
        if self.prompt_logprobs_n is not None:
            params["prompt_logprobs"] = self.prompt_logprobs_n
        for target in ("ttft_target_s", "itl_target_s"):
            if getattr(self, target) is not None:
                params[target] = getattr(self, target)
        guided, tools = self.structured()
        texts: dict[str, str | list[str]] = dict(guided)
        if self.logit_bias:
            texts["logit_bias"] = json.dumps(self.logit_bias)
        requests = []
        for prompt, messages in self._inputs():
            for j in range(self.n):
                seed = {"seed": self.seed + j} if self.seed is not None else {}
                requests.append(
                    GenerateRequest(
                        prompt,
                        messages,
                        {**params, **seed},
                        self.stop_strings,
                        cache_salt=cache_salt,
                        texts=texts,
                        tools=tools,
                        resumable=self.stream and self.resume_on_failure,
                    )
                )
        return requests


class ChatCompletionRequest(Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=LIMITS.max_messages)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, bounds("logprobs")] | None = None
    # Structured output and tool calling (runtime/gateway/structured.py).
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    _parse_tools: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise GatewayError.invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise GatewayError.invalid("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
        if self.tools:
            names = [t.function.name for t in self.tools]
            twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
            if twice is not None:
                raise GatewayError.invalid(f"function '{twice}' is defined twice", "tools")
        self._guided, self._parse_tools = chat_guided(self.response_format, self.tools, self.tool_choice,
                                                      self.parallel_tool_calls, self.guided())  # fmt: skip
        return self

    @property
    def tool_names(self) -> frozenset[str] | None:
        return frozenset(t.function.name for t in self.tools or ()) if self._parse_tools else None

    def structured(self) -> tuple[dict[str, str | list[str]], list[dict[str, Any]] | None]:
        return self._guided, upstream_tools(self.tools) if self._parse_tools else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _inputs(self) -> list[tuple[str | list[int] | None, list[dict[str, Any]] | None]]:
        return [(None, [m.as_upstream() for m in self.messages])]


class CompletionRequest(Generation):
    # Text or token ids (OpenAI's four forms: one of either, or a list of either)
    prompt: (
        PromptText
        | TokenIds
        | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_N)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_N)]
    )
    logprobs: Annotated[int, bounds("logprobs")] | None = None  # named `logprobs_n` elsewhere
    # The prompt before the completion, its tokens scored when `logprobs` is set (lm-eval's loglikelihood);
    # with max_tokens 0, the prompt alone.
    echo: bool = False
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = default("max_tokens")

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if len(self.prompts) * self.n > MAX_N:
            raise GatewayError.invalid(f"len(prompt) * n must be at most {MAX_N}", "n")
        if any(not p for p in self.prompts):
            raise GatewayError.invalid("'prompt' must not be empty", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise GatewayError.invalid(
                "'max_tokens' must be at least 1 (0 only with 'echo': the prompt scored, nothing generated)",
                "max_tokens",
            )
        if self.echo and self.stream:
            raise GatewayError.invalid("'echo' is not supported with 'stream'", "echo")
        if self.echo and self.n > 1:
            raise GatewayError.invalid("'echo' is not supported with 'n' above 1", "echo")
        return self

    @property
    def scores_only(self) -> bool:
        # The engine generates one token (its prompt's last logits are computed anyway), which is left out.
        return self.max_tokens == 0

    @property
    def echoed(self) -> tuple[str | list[int], ...] | None:
        return tuple(self.prompts) if self.echo else None

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # one prompt: text, or ids
        return list(self.prompt)

    @property
    def token_limit(self) -> int:
        return max(1, self.max_tokens) if self.max_tokens is not None else 16  # OpenAI's default for completions

    @property
    def logprobs_n(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_n(self) -> int | None:
        if self.prompt_logprobs is not None or not self.echo:
            return self.prompt_logprobs
        return self.logprobs  # echo scores the prompt as the completion's tokens are

    def _inputs(self) -> list[tuple[str | list[int] | None, list[dict[str, Any]] | None]]:
        return [(p, None) for p in self.prompts]

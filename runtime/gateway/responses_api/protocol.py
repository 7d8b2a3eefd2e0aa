"""The Responses API's request body: OpenAI's fields this server serves (strict, as the chat body is), and the
chat completion request it means.

`input` is text (one user message) or a list of items: messages (role and text content; `type` "message" may
be left out, as OpenAI's easy input messages do), `function_call` items (calls the model made, fed back) and
`function_call_output` items (their results). Consecutive calls join the assistant message before them, as
chat templates expect; an output must answer a call made earlier in the conversation. `instructions` become
the system message of this turn only (a stored conversation keeps none: OpenAI's rule). `text.format` and the
function `tools` go through the chat path's structured output (runtime/gateway/structured.py); hosted tools
(web search, file search, ...) and non-text content are refused naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, TypeAdapter, ValidationError, model_validator

from runtime.gateway.errors import GatewayError, from_validation
from runtime.gateway.protocol import LIMITS, ChatCompletionRequest, MaxTokens, PromptText, bounds, default
from runtime.gateway.strict import Strict
from runtime.gateway.structured import FunctionName

MAX_TOOLS = 128
MAX_ID_CHARS = 128
Message = dict[str, Any]  # a chat message, as ChatCompletionRequest's `messages` take it


class InputText(Strict):
    type: Literal["input_text", "output_text"]  # a user's text, or an assistant's fed back
    text: str
    annotations: list[Any] | None = None  # (output_text fed back: kept by clients, not read)
    logprobs: list[Any] | None = None


TextParts = Annotated[list[InputText], Field(min_length=1, max_length=LIMITS.max_messages)]
Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: PromptText | TextParts
    id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it
    id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
    output: PromptText | TextParts
    id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    status: Status | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


_KINDS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}


def _kind(value: Any) -> str | None:
    """The item's model (capitalized tags: runtime.gateway.errors leaves them out of the field's path)."""
    return _KINDS.get(value.get("type", "message")) if isinstance(value, dict) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(
        _kind,
        custom_error_type="invalid_item",
        custom_error_message="an item's 'type' must be "
        "'message' (the default), 'function_call' or 'function_call_output'",
    ),
]
OUTPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            missing = "name" if self.name is None else "schema"
            raise GatewayError.invalid(f"a 'json_schema' format needs '{missing}'", f"text.format.{missing}")
        if self.type != "json_schema" and (self.name is not None or self.schema_ is not None):
            raise GatewayError.invalid("'name' and 'schema' go with type 'json_schema' only", "text.format")
        return self

    def as_chat(self) -> dict[str, Any]:
        """Chat's `response_format`."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(Strict):
    format: TextFormat = TextFormat.model_validate({"type": "text"})


class FunctionTool(Strict):
    type: Literal["function"]  # OpenAI's hosted tools (web_search, file_search, ...) run at OpenAI only
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: FunctionName


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]


class ResponsesRequest(Strict):
    model: str
    input: PromptText | Annotated[list[InputItem], Field(min_length=1, max_length=LIMITS.max_messages)]
    instructions: PromptText | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, bounds("temperature")] = default("temperature")
    top_p: Annotated[float, bounds("top_p")] = default("top_p")
    stream: bool = False
    text: TextConfig = TextConfig()
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id}, as OpenAI's default
    metadata: Metadata | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"  # "auto" (dropping the conversation's middle) is not served
    _turn: list[Message] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _checks(self) -> ResponsesRequest:
        if isinstance(self.input, str):
            self._turn = [{"role": "user", "content": self.input}]
        else:
            self._turn = chat_messages(self.input)
        return self

    @property
    def turn(self) -> list[Message]:
        """This request's input as chat messages (without the instructions)."""
        return self._turn

    def chat_request(self, history: list[Message]) -> ChatCompletionRequest:
        """The chat completion request this turn means after `history` (a stored conversation); a 400 naming
        this body's field when the conversation cannot go on (an output answering no call, a bad schema)."""
        _check_outputs_answer_calls(history, self.input if isinstance(self.input, list) else [])
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.turn,
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "response_format": self.text.format.as_chat(),
            "user": self.user,
        }
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
            chat["parallel_tool_calls"] = self.parallel_tool_calls
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as exc:
            raise _renamed(from_validation(exc)) from None
        except GatewayError as exc:
            raise _renamed(exc) from None

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "text": {"format": self.text.format.echo()},
            "previous_response_id": self.previous_response_id,
            "metadata": self.metadata or {},
            "store": self.store,
            "truncation": self.truncation,
            "user": self.user,
        }


def chat_messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[Message]:
    """Items as chat messages: calls join the assistant message before them (or start one)."""
    out: list[Message] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "content": item.text, "tool_call_id": item.call_id})
    return out


def output_messages(output: list[dict[str, Any]]) -> list[Message]:
    """A response's output items (messages and calls, as this server wrote them) as chat messages."""
    return chat_messages(OUTPUT_ITEMS.validate_python(output))


def _check_outputs_answer_calls(history: list[Message], items: list[Any]) -> None:
    calls = {c["id"] for m in history for c in m.get("tool_calls", ())}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise GatewayError.invalid(
                f"no function call with call_id {item.call_id!r} precedes this output "
                "(in this input or the previous response's)",
                f"input[{i}].call_id",
            )


# The chat body's names for this body's fields, in errors (most specific first).
_NAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("messages", "input"),
)


def _renamed(exc: GatewayError) -> GatewayError:
    param = exc.param or ""
    for chat, ours in _NAMES:
        if param.startswith(chat):
            renamed = ours if chat == "messages" else ours + param[len(chat) :]
            exc.message = exc.message.replace(f"'{param}'", f"'{renamed}'")
            exc.param = renamed
            break
    if param.startswith("tools[") and ".function." in param:
        exc.param = param.replace(".function.", ".", 1)
        exc.message = exc.message.replace(f"'{param}'", f"'{exc.param}'")
    return exc

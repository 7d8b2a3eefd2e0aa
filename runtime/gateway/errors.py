"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can see is a GatewayError; pydantic's validation errors are turned
into 400s naming the parameter, so no upstream 500 ever reaches a client for bad input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.responses import JSONResponse

# Parameters of OpenAI's API this server does not implement: named as unsupported, not unknown.
UNSUPPORTED = frozenset({
    "audio", "background", "best_of", "context_management", "conversation", "function_call", "functions",
    "include", "max_tool_calls", "metadata", "modalities", "prompt", "prompt_cache_retention", "reasoning",
    "prediction", "prompt_cache_key", "reasoning_effort", "safety_identifier", "service_tier", "store",
    "stream_options", "suffix", "top_logprobs", "verbosity", "web_search_options",
})  # fmt: skip
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# Retry-After of a 503: a tritonserver that died is restarted by `trtserve serve`'s supervisor within seconds.
UNAVAILABLE_RETRY_AFTER_S = 5.0


@dataclass
class GatewayError(Exception):
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> GatewayError:
        return cls(400, message, "invalid_request_error", param, code)

    @classmethod
    def overloaded(cls, message: str, retry_after_s: float | None = None) -> GatewayError:
        return cls(429, message, "rate_limit_error", code="overloaded", retry_after_s=retry_after_s)

    @classmethod
    def unavailable(cls, message: str, code: str = "no_healthy_backend",
                    retry_after_s: float = UNAVAILABLE_RETRY_AFTER_S) -> GatewayError:  # fmt: skip
        """503: no replica can serve now (down, restarting, draining); always with Retry-After."""
        return cls(503, message, "service_unavailable", code=code, retry_after_s=retry_after_s)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:  # whole seconds (RFC 9110), and milliseconds as the openai SDK reads
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, round(self.retry_after_s * 1000)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream's 200 went out."""
        return f"data: {json.dumps(self.body())}\n\n"


def client_gone() -> GatewayError:
    """The client left before its answer (never sent: there is nobody to send it to; counted as 499)."""
    return GatewayError(499, "the client closed the request", "client_closed")


def from_validation(exc: ValidationError) -> GatewayError:
    """A problem pydantic found, with the parameter named: the most specific one (for a union, the
    member that got furthest into the value: a list with one bad element names that element)."""
    error = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    path = _path(error["loc"])
    top = str(error["loc"][0]) if error["loc"] else None
    if error["type"] == "extra_forbidden":
        if len(error["loc"]) == 1 and top in UNSUPPORTED:
            return GatewayError.invalid(f"'{top}' is not supported by this server", top, "unsupported_parameter")
        return GatewayError.invalid(f"unknown parameter '{path}'", path, "unknown_parameter")
    if error["type"] == "missing":
        return GatewayError.invalid(f"'{path}' is required", path, "missing_required_parameter")
    return GatewayError.invalid(f"'{path}': {error['msg']}", path, "invalid_value")


def unknown_model(model: str, served: list[str]) -> GatewayError:
    return GatewayError(404, f"The model '{model}' does not exist (served: {', '.join(served)})",
                        "invalid_request_error", "model", "model_not_found")  # fmt: skip


def _path(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union-member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part[0].islower() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out

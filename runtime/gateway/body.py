"""A request's JSON body, bounded and checked before anything parses it (the OpenAI routes and Triton's door).

Order: size (413: a declared Content-Length over the limit is refused unread; a body without one is read no
further than the limit), content type (415: only application/json, or none; curl's --data default,
form-urlencoded, is what crashes Triton's own HTTP parser at a few MB), UTF-8, nesting depth (json.loads
recurses once a level: a deep document must be a 400, not a RecursionError), JSON, an object (400). The
body is read before its content type is judged: a client still sending would see a reset, not the answer.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from engine_format.requests import json_depth_exceeds
from runtime.gateway.errors import GatewayError, client_gone, from_validation
from runtime.gateway.protocol import MAX_BODY_BYTES, MAX_JSON_DEPTH

Model = TypeVar("Model", bound=BaseModel)


async def read_model(http: Request, schema: type[Model]) -> Model:
    """The body (bounded, JSON: read_json) validated as `schema` (a 400 naming the field)."""
    data = await read_json(http)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def read_json(http: Request) -> dict[str, Any]:
    """The body as a JSON object; GatewayError (413, 415, 400, 499 if the client left) otherwise."""
    raw = await read_body(http)
    content_type = http.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise GatewayError(415, f"Content-Type must be application/json (got {content_type!r})",
                           "invalid_request_error", code="unsupported_media_type")  # fmt: skip
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GatewayError.invalid(f"the body is not valid UTF-8: {exc}") from None
    if json_depth_exceeds(text, MAX_JSON_DEPTH):
        raise GatewayError.invalid(f"the body nests more than {MAX_JSON_DEPTH} levels deep", code="too_deep")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GatewayError.invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError.invalid("the body must be a JSON object")
    return data


async def read_body(http: Request) -> bytes:
    too_large = GatewayError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", "invalid_request_error",
                             code="request_too_large")  # fmt: skip
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in http.stream():  # read no further than the limit, whatever the header said
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut by the body timeout (runtime.gateway.timeouts)
        raise client_gone() from None
    return b"".join(chunks)

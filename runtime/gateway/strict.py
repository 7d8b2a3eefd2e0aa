"""The base of the gateway's request bodies: strict types, unknown fields refused, null taken as not sent."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Strict(BaseModel):
    """Strict: "5" is not an integer and true is not a number, as in OpenAI's API; unknown fields are errors
    (errors.from_validation names them); a field sent as null counts as not sent."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

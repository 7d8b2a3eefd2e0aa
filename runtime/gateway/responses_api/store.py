"""Finished responses, kept for `previous_response_id` and `GET /v1/responses/{id}`: per owner (the tenant,
or everyone on a gateway without keys), bounded in count and size per owner, each for a limited time.

An id is found only by its owner: another tenant's id is answered as one that does not exist (404), so ids
reveal nothing across tenants. When an owner's responses outgrow their bounds the oldest go first; a
conversation is stored whole with each response (its turns up to then), so dropping an old response never
breaks a newer one's chain.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.gateway.errors import GatewayError
from runtime.gateway.tenants import Tenant

MAX_PER_OWNER = 1024
MAX_CHARS_PER_OWNER = 256 * 2**20  # a conversation's JSON text: ~256 MiB of memory at most per tenant
TTL_S = 3600.0
OPEN = ""  # the owner on a gateway without keys


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the Response object, as it was answered
    conversation: list[dict[str, Any]]  # chat messages up to and with its output (no instructions)
    expires_at: float
    chars: int


def owner_of(tenant: Tenant | None) -> str:
    return tenant.name if tenant is not None else OPEN


class ResponseStore:
    def __init__(
        self,
        max_per_owner: int = MAX_PER_OWNER,
        max_chars_per_owner: int = MAX_CHARS_PER_OWNER,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_per_owner, self.max_chars_per_owner, self.ttl_s = max_per_owner, max_chars_per_owner, ttl_s
        self.clock = clock
        self._owners: dict[str, OrderedDict[str, Stored]] = {}
        self._chars: dict[str, int] = {}

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = len(json.dumps(conversation)) + len(json.dumps(response))
        if chars > self.max_chars_per_owner:
            return  # larger than the owner's whole budget: answered, not kept
        self._expire(owner)
        kept = self._owners.setdefault(owner, OrderedDict())
        kept[response["id"]] = Stored(response, conversation, self.clock() + self.ttl_s, chars)
        self._chars[owner] = self._chars.get(owner, 0) + chars
        while len(kept) > self.max_per_owner or self._chars[owner] > self.max_chars_per_owner:
            self._drop(owner, next(iter(kept)))

    def get(self, owner: str, response_id: str, param: str | None = None) -> Stored:
        """The owner's response `response_id`; a 404 naming `param` if it is not (or no longer) kept."""
        self._expire(owner)
        kept = self._owners.get(owner)
        stored = kept.get(response_id) if kept is not None else None
        if stored is None:
            raise GatewayError(
                404,
                f"no response with id {response_id!r} is kept for this key (never stored, "
                f"expired after {self.ttl_s:g} s, deleted, or another key's)",
                "invalid_request_error",
                param,
                "response_not_found",
            )
        return stored

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        self._drop(owner, response_id)

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._owners.values())

    def _expire(self, owner: str) -> None:
        kept, now = self._owners.get(owner), self.clock()
        while kept and next(iter(kept.values())).expires_at <= now:  # oldest first: expiries in order
            self._drop(owner, next(iter(kept)))

    def _drop(self, owner: str, response_id: str) -> None:
        stored = self._owners[owner].pop(response_id)
        self._chars[owner] -= stored.chars
        if not self._owners[owner]:
            del self._owners[owner], self._chars[owner]

"""The engine's id for each caller's request: the caller's id, numbered (`take`).

A caller may reuse its request id as soon as its stream ended, and a stream can end before the engine has
finished with the request: a stop string found by the text, a caller that left, while a step's outputs are on
their way. Under an id of its own, the request before is still told apart: its late outputs name an id the
output processor no longer holds and are dropped, and the core's final output of a stop-string request still
brings its stats to the metrics. So the engine core, the output processor and the streams speak engine ids; the
caller's id is what a delta carries (AsyncLLM.generate) and what the disaggregation door is called with.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.engine.core_client import CoreProcessDisagg
from runtime.engine.disagg import Disagg, DisaggStats
from runtime.engine.kv_import import Import, PullRecord

SEPARATOR = "#"
T = TypeVar("T")


class RequestIds:
    def __init__(self) -> None:
        self._numbers = itertools.count(1)
        self._reserved: dict[str, str] = {}  # caller's id -> the engine id its next request takes
        self._lock = threading.Lock()  # the door's calls and generate may come from different threads

    def reserve(self, request_id: str) -> str:
        """The engine id the caller's next request `request_id` will take, given out before it is added (the
        disaggregation door registers a KV handle or a prefill-only mark first)."""
        with self._lock:
            if request_id not in self._reserved:
                self._reserved[request_id] = self._new(request_id)
            return self._reserved[request_id]

    def take(self, request_id: str) -> str:
        """The engine id of the caller's request being added now: the one reserved for it, or a new one."""
        with self._lock:
            return self._reserved.pop(request_id, None) or self._new(request_id)

    def unreserve(self, request_id: str, engine_id: str) -> None:
        """Drop `engine_id` if it is still reserved for `request_id` (no request took it)."""
        with self._lock:
            if self._reserved.get(request_id) == engine_id:
                del self._reserved[request_id]

    def _new(self, request_id: str) -> str:
        return f"{request_id}{SEPARATOR}{next(self._numbers)}"


def caller_id(engine_id: str) -> str:
    """The caller's id an engine id was made from."""
    return engine_id.rpartition(SEPARATOR)[0]


class DisaggDoor:
    """The disaggregation door's calls (runtime/triton_model/kv_door.py), made before the request is added: each
    takes the caller's request id and is passed on under the engine id the request will take, which it returns
    (`export`; `expect`'s Import carries it). `forget` takes that engine id back once the request ended, so a
    request under the same caller's id, started meanwhile, keeps its own reservation."""

    def __init__(self, ids: RequestIds, disagg: Disagg | CoreProcessDisagg) -> None:
        self.ids, self.disagg = ids, disagg

    @property
    def role(self) -> str:
        return self.disagg.role

    def export(self, request_id: str) -> str:
        engine_id = self.ids.reserve(request_id)
        self._or_unreserve(request_id, engine_id, self.disagg.export, engine_id)
        return engine_id

    def expect(self, request_id: str, handle_text: str, cache_salt: str | None, lora: str | None = None) -> Import:
        engine_id = self.ids.reserve(request_id)
        return self._or_unreserve(request_id, engine_id, self.disagg.expect, engine_id, handle_text, cache_salt, lora)

    async def pull(self, imp: Import) -> None:
        await self.disagg.pull(imp)

    def forget(self, engine_id: str) -> None:
        """The request given `engine_id` (by export, or expect's Import) ended or never started."""
        self.disagg.forget(engine_id)
        self.ids.unreserve(caller_id(engine_id), engine_id)

    def stats(self) -> DisaggStats:
        return self.disagg.stats()

    def take_pull_records(self) -> list[PullRecord]:
        return self.disagg.take_pull_records()

    def _or_unreserve(self, request_id: str, engine_id: str, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)`; if it refuses (InvalidRequest, a dead core), the reservation goes with it."""
        try:
            return call(*args)
        except BaseException:
            self.ids.unreserve(request_id, engine_id)
            raise

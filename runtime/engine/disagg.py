"""Prefill/decode disaggregation in the engine: the worker's role, and the hooks the engine loop calls.

Roles (EngineArgs.role, `trtserve serve --role`):
- "both" (the default): a worker as before. It also serves handles marked `recompute` (the gateway's
  fallback when a decode worker could not read the KV): it computes the prompt and continues after the
  prefill's first token. No transfer agent is started, so NIXL need not be installed.
- "prefill": requests sent `prefill_only` run their prompt, sample the first token and end there with
  finish reason "handoff": their blocks stay pinned (kv_pins.py) and the final output carries the KV
  handle (engine_format/kv_handle.py) for a decode worker.
- "decode": requests that carry a handle read the prompt's KV from the prefill worker (kv_import.py) and
  go on decoding. Both transfer roles register the KV pool with a connector (executors/kv_transfer/) at start.

The engine asks four hooks, each one line in llm_engine.py, and changes no request state through them:
`take_export` and `adopt` (add_request: whether the request is prefill-only, which the step update ends
with its first token; a request with a handle skips the queue), `kv_handle` (the step update ends a
prefill-only request: its blocks pinned, its handle named in the final output) and `held_blocks` (the pool
invariant counts pinned and staged blocks). A reaper thread ends pins whose reader is done (the connector's
notifications) or whose time is up, and frees abandoned stages: the engine loop sleeps while it has no
requests, and pins must end all the same. The reaper and a pull (on the door's event loop) change the KV
pool from threads of their own, so they take the lock that guards it: the engine's.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_format import EngineConfig, ceil_div
from engine_format.kv_handle import HANDOFF, KVHandle
from engine_format.kv_identity import kv_identity, kv_layout
from executors.kv_transfer import KVConnector, KVTransferError, create_connector, kv_memory
from runtime.engine.engine_args import ROLES
from runtime.engine.errors import InvalidRequest
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.kv_import import Import, KVImports, PullRecord
from runtime.engine.kv_pins import KVPins
from runtime.engine.request import Request
from runtime.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.02

__all__ = ["HANDOFF", "Disagg", "DisaggStats", "KVTransferError"]


@dataclass(frozen=True)
class DisaggStats:
    role: str
    handoffs: int
    pinned_blocks: int
    pins_released: int
    pins_expired: int
    staged_blocks: int
    pulls: int
    pull_failures: int
    pulled_bytes: int
    recomputes: int


class Disagg:
    def __init__(self, role: str, pin_timeout_s: float, kv: KVCacheManager, scheduler: Scheduler,
                 pool_lock: Any, clock: Callable[[], float], connector: KVConnector | None = None) -> None:  # fmt: skip
        """`pool_lock`: the lock under which the engine changes the KV pool (its own)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)} (got {role!r})")
        self.role, self.connector, self.pool_lock = role, connector, pool_lock
        self.pins = KVPins(kv.pool, pin_timeout_s, clock)
        reader = connector if role == "decode" else None
        self.imports = KVImports(kv, scheduler, reader, pool_lock, clock, pin_timeout_s)
        self.block_size = kv.block_size
        self.handoffs = 0
        self._exports: set[str] = set()  # request ids marked prefill-only, not yet added
        self._exports_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        if connector is not None:
            self._reaper = threading.Thread(target=self._reap, name="trtserve-kv-reaper", daemon=True)
            self._reaper.start()

    @classmethod
    def create(cls, role: str, pin_timeout_s: float, config: EngineConfig, backend: Any, kv: KVCacheManager,
               scheduler: Scheduler, pool_lock: Any, clock: Callable[[], float]) -> Disagg:  # fmt: skip
        """The engine's: a connector over the backend's pool for the transfer roles (KVTransferError when
        NIXL is missing), none for "both"."""
        connector = None
        if role != "both":
            connector = create_connector("nixl", kv_memory(backend, kv_layout(config)), kv_identity(config))
            log.info("role %s: KV connector %s, agent %s", role, connector.kind, connector.agent_name)
        return cls(role, pin_timeout_s, kv, scheduler, pool_lock, clock, connector)

    # ---- the doors' calls, before a request reaches the engine ----------------------------------

    def export(self, request_id: str) -> None:
        """Mark a request prefill-only, before it is added: it ends after its first token, handing its KV on."""
        if self.role != "prefill":
            raise InvalidRequest("prefill_only", f"this worker's role is {self.role!r}; start it with --role prefill")
        with self._exports_lock:
            self._exports.add(request_id)

    def expect(self, request_id: str, handle_text: str, cache_salt: str | None, lora: str | None = None) -> Import:
        """Register the KV handle of a request for adapter `lora` (InvalidRequest if unusable here); then
        `await pull(...)`."""
        return self.imports.expect(request_id, handle_text, cache_salt, lora)

    async def pull(self, imp: Import) -> None:
        await self.imports.pull(imp)

    def forget(self, request_id: str) -> None:
        """The request ended (or never started): drop its marks and free anything staged for it."""
        with self._exports_lock:
            self._exports.discard(request_id)
        self.imports.discard(request_id)

    # ---- the engine's hooks ------------------------------------------------------------------

    def take_export(self, request_id: str) -> bool:
        """add_request's hook: whether the request was marked prefill-only (the mark is taken)."""
        if not self._exports:  # the common case, every worker but a prefill one: no lock
            return False
        with self._exports_lock:
            if request_id not in self._exports:
                return False
            self._exports.discard(request_id)
            return True

    def adopt(self, request: Request, resume: Callable[[Request, list[int]], None]) -> bool:
        """add_request's hook, under the engine's lock: see kv_import.py."""
        return self.imports.adopt(request, resume)

    def kv_handle(self, request: Request) -> str:
        """The step update's hook as a prefill-only request ends with its first token (under the engine's lock,
        before its own references go): its prompt's blocks pinned for a decode worker, the handle's JSON. The
        text of its final output is that token's delta alone (the output processor does not flush what the
        detokenizer holds back: that is the decode worker's to send, which replays the token into its own)."""
        self.handoffs += 1
        return self._pin(request).to_json()

    def held_blocks(self) -> list[list[int]]:
        """Block references held outside requests (pins, staged pulls): the invariant check adds them."""
        return [list(b) for b in self.pins.held()] + self.imports.held()

    # ---- observability and shutdown ----------------------------------------------------------

    def stats(self) -> DisaggStats:
        imports = self.imports
        return DisaggStats(self.role, self.handoffs, self.pins.num_blocks, self.pins.released, self.pins.expired,
                           imports.num_staged_blocks, imports.pulls, imports.failures, imports.pulled_bytes,
                           imports.recomputes)  # fmt: skip

    def take_pull_records(self) -> list[PullRecord]:
        records, self.imports.records = self.imports.records, []
        return records

    def close(self) -> None:
        """Stop the reaper and close the connector; once (later calls do nothing)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join()
        if self.connector is not None:
            self.connector.close()

    def _pin(self, request: Request) -> KVHandle:
        assert self.connector is not None, "role prefill has a connector"
        num_prompt = request.num_prompt_tokens
        blocks = request.block_ids[: ceil_div(num_prompt, self.block_size)]
        handle_id = uuid.uuid4().hex
        self.pins.pin(handle_id, blocks)
        return KVHandle(
            handle_id=handle_id,
            connector=self.connector.kind,
            agent=self.connector.agent_name,
            agent_metadata=self.connector.metadata(),
            identity=self.connector.identity,
            layout=self.connector.layout,
            regions=self.connector.memory.regions,
            block_ids=tuple(blocks),
            prompt_token_ids=tuple(request.prompt_token_ids),
            first_token=request.all_token_ids[num_prompt],
            lora=request.lora_id,
            expires_at=time.time() + self.pins.timeout_s,
        )

    def _reap(self) -> None:
        assert self.connector is not None
        while not self._stop.wait(REAP_INTERVAL_S):
            try:
                done = self.connector.take_notifications()
                with self.pool_lock:
                    for message in done:
                        self.pins.release(message.decode(errors="replace"))
                    if self.pins.expire():
                        log.warning("KV pins expired unread (decode worker gone, or the request abandoned)")
                self.imports.expire()
            except Exception:  # the reaper must outlive one bad round
                log.exception("KV reaper round failed")
